"""The generic connector path (workers/kv/connector.py), the one a backend that is only a
module in connectors.py (mori) takes, driven here by the nixl backend's worker-side half on
CPU caches: a spawned source serves its connector export over the real KVTransferServicer
(ExportConnector, LeaseKV); this process's KVConnector opens it through KV rank ops on a
one-rank RankKV and pulls scattered blocks bit for bit. A handle naming another export id
(the source restarted) is refused before anything is read; a handle without the backend's
endpoint is a failure to fall back from, with nothing written."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from helpers.kv_source import NUM_BLOCKS, KVSource, OneRank, make_caches

from tandem.common.kv_exports import ConnectorEndpoint, KVHandle
from tandem.common.kv_layout import KVLayout
from tandem.workers.kv import nixl_backend
from tandem.workers.kv.connector import KVConnector
from tandem.workers.kv.cuda_ipc import flat_caches
from tandem.workers.kv.rank_group import RankGroupKV
from tandem.workers.kv.rank_ops import RankKV
from tandem.workers.kv_transfer_service import KVPeerClient

if not nixl_backend.is_installed():
    pytest.skip("nixl is an optional extra (pip install 'tandem[nixl]')",
                allow_module_level=True)

HANDLES = {"scattered": [11, 2, 5, 6, 7, 19, 0]}
DST_IDS = [4, 17, 9, 10, 11, 0, 22]
LOCAL_BLOCKS = 23


@pytest.fixture(scope="module")
def source():
    source = KVSource.start(("mha",), HANDLES, connector=True)
    yield source
    source.stop()


def pull(source: KVSource, export_id: str | None):
    """A fresh receiver pulls "scattered" into DST_IDS; (answer, its caches)."""
    caches = make_caches("mha", LOCAL_BLOCKS, seed=None)
    layout = KVLayout.from_kv_caches(caches, kind="mha")
    connectors = {} if export_id is None else {"nixl": ConnectorEndpoint(export_id)}
    handle = KVHandle("scattered", len(HANDLES["scattered"]), ("nixl", "grpc"),
                      connectors=connectors)

    async def main():
        ranks = RankGroupKV(OneRank(RankKV(caches, torch.device("cpu"), 0, 1)), 1)
        connector = await KVConnector.start("nixl", ranks, layout, "auto")
        address = source.address("mha")
        async with grpc.aio.insecure_channel(address) as channel:
            return await connector.pull(KVPeerClient(channel, layout), address, handle,
                                        DST_IDS, 0, 20.0)

    try:
        return asyncio.run(main()), caches
    except ValueError as exc:
        return exc, caches


def test_a_connector_backend_pulls_scattered_blocks_bit_exactly(source):
    (num_bytes, failure), caches = pull(source, source.connector_export_ids["mha"])
    assert failure is None
    layout = KVLayout.from_kv_caches(caches, kind="mha")
    assert num_bytes == len(DST_IDS) * layout.bytes_per_layer_block * layout.num_layers
    src_ids = HANDLES["scattered"]
    untouched = [b for b in range(LOCAL_BLOCKS) if b not in DST_IDS]
    for s, d in zip(flat_caches(make_caches("mha", NUM_BLOCKS)), flat_caches(caches)):
        assert torch.equal(s[src_ids].view(torch.int16), d[DST_IDS].view(torch.int16))
        assert not d[untouched].view(torch.int16).any()


def test_a_stale_export_id_or_no_endpoint_reads_nothing(source):
    error, caches = pull(source, "an-old-export")
    assert isinstance(error, ValueError) and "restarted" in str(error)
    (num_bytes, failure), caches_without = pull(source, None)
    assert num_bytes == 0 and "without an endpoint" in failure
    for c in (caches, caches_without):
        assert not any(t.view(torch.int16).any() for t in flat_caches(c))
