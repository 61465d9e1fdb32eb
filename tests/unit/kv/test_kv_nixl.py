"""The nixl KV backend on CPU caches ("DRAM"), through real NIXL agents (UCX): a spawned
source process serves the real KVTransferServicer with a NIXL agent per layout kind; this
process pulls scattered blocks with KVReceiver in nixl mode and compares bytes. Plus the
descriptor arithmetic, mismatches and failures (handle released, source gone)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import grpc
import numpy as np
import pytest
import torch
from helpers.kv_source import NUM_BLOCKS, KVSource, make_caches

from tandem.common.convert import kv_handle_from_proto, layout_to_proto, nixl_export_from_proto
from tandem.v1 import worker_pb2
from tandem.workers.kv import nixl_backend, transport
from tandem.workers.kv.block_access import DirectKVBlocks
from tandem.workers.kv.cuda_ipc import flat_caches
from tandem.common.kv_layout import KVLayout, KVLayoutMismatch
from tandem.workers.kv.nixl_backend import (NixlKVAgent, TensorBlocks, block_runs,
                                            descriptor_rows, registration_regions)
from tandem.workers.kv.receiver import KVReceiver
from tandem.workers.kv_transfer_service import KVPeerClient

if not nixl_backend.is_installed():
    pytest.skip("nixl is an optional extra (pip install 'tandem[nixl]')",
                allow_module_level=True)

KINDS = ("mha", "mla", "mla_indexer")
# Scattered source blocks with a run (5, 6, 7) that meets a run on the receiver's side too.
HANDLES = {"scattered": [11, 2, 5, 6, 7, 19, 0], "released": [3, 4], "killed": [8, 9, 1]}
DST_IDS = [4, 17, 9, 10, 11, 0, 22]
LOCAL_BLOCKS = 23


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


@pytest.fixture(scope="module")
def source():
    source = KVSource.start(KINDS, HANDLES)
    yield source
    source.stop()


class Receiver:
    """A decode side: zeroed caches of one kind, its own NIXL agent, a KVReceiver."""

    def __init__(self, kind: str, mode: str = "nixl") -> None:
        self.caches = make_caches(kind, LOCAL_BLOCKS, seed=None)
        self.layout = KVLayout.from_kv_caches(self.caches, kind=kind)
        self.agent = NixlKVAgent(self.caches, self.layout)
        self.receiver = KVReceiver(mode, self.layout, DirectKVBlocks(self.caches), self.caches,
                                   torch.device("cpu"), 1, self.agent)

    def handle(self, source: KVSource, kind: str, handle_id: str) -> worker_pb2.KVHandle:
        num_blocks = len(HANDLES[handle_id])
        return worker_pb2.KVHandle(
            handle_id=handle_id, backend="grpc", source_address=source.address(kind),
            layout=layout_to_proto(self.layout), num_tokens=num_blocks * 4,
            num_blocks=num_blocks, transports=["nixl", "grpc"],
            nixl=worker_pb2.NixlEndpoint.FromString(source.endpoints[kind]))

    async def pull(self, source, kind, handle_id, dst_ids, start_block=0, timeout=20.0):
        async with grpc.aio.insecure_channel(source.address(kind)) as channel:
            return await self.receiver.pull(
                KVPeerClient(channel, self.layout), source.address(kind),
                kv_handle_from_proto(self.handle(source, kind, handle_id)), dst_ids,
                start_block, timeout)


@pytest.mark.parametrize("kind", KINDS)
def test_nixl_pulls_scattered_blocks_bit_exactly(source, kind):
    """Every cache tensor of every layer (K and V; the latent; the latent and the narrower
    indexer keys) arrives byte for byte, NaN patterns included; no other block is touched."""
    rx = Receiver(kind)
    num_bytes, backend = asyncio.run(rx.pull(source, kind, "scattered", DST_IDS))
    assert backend == transport.NIXL
    src_ids = HANDLES["scattered"]
    expected = flat_caches(make_caches(kind, NUM_BLOCKS))
    local = flat_caches(rx.caches)
    assert num_bytes == len(src_ids) * rx.layout.bytes_per_layer_block * rx.layout.num_layers
    assert any(t.isnan().any() for t in expected)  # bytes, not values, are compared
    untouched = [b for b in range(LOCAL_BLOCKS) if b not in DST_IDS]
    for i, (s, d) in enumerate(zip(expected, local)):
        assert same_bytes(s[src_ids], d[DST_IDS]), f"cache tensor {i} differs"
        assert not d[untouched].view(torch.int16).any(), f"cache tensor {i}: stray bytes"


def test_nixl_pull_skips_the_blocks_the_receiver_has_cached(source):
    rx = Receiver("mha")
    src_ids = HANDLES["scattered"][3:]
    asyncio.run(rx.pull(source, "mha", "scattered", DST_IDS[3:], start_block=3))
    for s, d in zip(flat_caches(make_caches("mha", NUM_BLOCKS)), flat_caches(rx.caches)):
        assert same_bytes(s[src_ids], d[DST_IDS[3:]])
        assert not d[DST_IDS[:3]].view(torch.int16).any()


def test_concurrent_first_pulls_load_the_source_agent_once(source, caplog):
    """Two handles pulled together from a source not yet loaded: one ExportNixlAgent and
    add_peer, both READs land."""
    rx = Receiver("mla_indexer")

    async def both():
        return await asyncio.gather(
            rx.pull(source, "mla_indexer", "scattered", DST_IDS),
            rx.pull(source, "mla_indexer", "killed", [1, 2, 3]))

    with caplog.at_level("INFO", logger="tandem.workers.kv.nixl_receiver"):
        assert [backend for _, backend in asyncio.run(both())] == ["nixl", "nixl"]
    assert sum("loaded agent" in r.getMessage() for r in caplog.records) == 1
    expected = flat_caches(make_caches("mla_indexer", NUM_BLOCKS))
    for s, d in zip(expected, flat_caches(rx.caches)):
        assert same_bytes(s[HANDLES["scattered"]], d[DST_IDS])
        assert same_bytes(s[HANDLES["killed"]], d[[1, 2, 3]])


def test_a_layout_mismatch_is_refused_before_any_read(source):
    """An MHA receiver asks the MLA source for its agent: FAILED_PRECONDITION naming both
    kinds; a tampered export (other block sizes) is refused by add_peer."""
    rx = Receiver("mha")
    handle = rx.handle(source, "mla", "scattered")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(rx.pull(source, "mla", "scattered", DST_IDS))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "kind: source 'mla' != receiver 'mha'" in info.value.details()
    assert handle.nixl.agent_name  # the handle did name an agent

    async def export(kind):
        from tandem.v1 import worker_pb2_grpc

        async with grpc.aio.insecure_channel(source.address(kind)) as channel:
            return await worker_pb2_grpc.KVTransferStub(channel).ExportNixlAgent(
                worker_pb2.ExportNixlAgentRequest(expected_layout=layout_to_proto(rx.layout)))

    response = asyncio.run(export("mha"))
    response.tensors[3].block_bytes += 2
    with pytest.raises(ValueError, match="cache tensor 3: the source's blocks are"):
        rx.agent.add_peer(nixl_export_from_proto(response))
    mla = Receiver("mla")
    with pytest.raises(KVLayoutMismatch, match="'mha' KV cache and this worker a 'mla'"):
        mla.agent.add_peer(nixl_export_from_proto(asyncio.run(export("mha"))))


def test_bad_block_ids_are_refused(source):
    rx = Receiver("mla")
    with pytest.raises(ValueError, match="source leased 2 blocks from block 0, receiver "
                                         "expected 1"):
        asyncio.run(rx.pull(source, "mla", "released", [1]))
    with pytest.raises(ValueError, match=f"destination block {LOCAL_BLOCKS} is outside"):
        asyncio.run(rx.pull(source, "mla", "released", [0, LOCAL_BLOCKS]))


def test_a_released_handle_fails_the_pull_naming_it(source):
    rx = Receiver("mla")

    async def release_then_pull():
        from tandem.v1 import worker_pb2_grpc

        async with grpc.aio.insecure_channel(source.address("mla")) as channel:
            await worker_pb2_grpc.KVTransferStub(channel).ReleaseKV(
                worker_pb2.ReleaseKVRequest(handle_id="released"))
        return await rx.pull(source, "mla", "released", [0, 1])

    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(release_then_pull())
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'released' is unknown or its lease expired" in info.value.details()
    assert not any(t.view(torch.int16).any() for t in flat_caches(rx.caches))


def test_a_read_from_a_vanished_agent_fails_with_its_name():
    """The source process dies after the receiver loaded its agent and leased its blocks: the
    READ fails (or times out) with KVTransferFailed naming the agent."""
    from tandem.workers.kv.transport import KVTransferFailed

    own = KVSource.start(("mha",), {"killed": HANDLES["killed"]})
    try:
        rx = Receiver("mha")
        asyncio.run(rx.pull(own, "mha", "killed", [0, 1, 2]))  # loads the agent
        peer = rx.receiver.nixl.loaded(own.address("mha"))
        own.kill()
        with pytest.raises(KVTransferFailed, match=f"from agent {peer.agent_name}"):
            asyncio.run(rx.agent.read_blocks(peer, [8, 9, 1], [3, 4, 5], timeout=5.0))
    finally:
        own.kill()


def test_a_cancelled_read_writes_nothing_after_the_cancel_and_the_agent_reads_on(source):
    """A caller that goes away: a READ cancelled before its turn on the agent's thread never
    starts (its blocks stay zero), one cancelled mid-way re-raises CancelledError only once
    it is over, and the agent's thread then serves the next READ bit for bit."""
    from tandem.workers.kv.transport import KVTransferFailed

    rx = Receiver("mha")
    asyncio.run(rx.pull(source, "mha", "killed", [1, 2, 3]))  # loads the agent
    peer = rx.receiver.nixl.loaded(source.address("mha"))
    src_ids = HANDLES["scattered"]
    gate = threading.Event()
    rx.agent._agent._thread.submit(gate.wait)  # hold the agent's thread busy
    read = rx.agent.post_read(peer, src_ids, DST_IDS, timeout=5.0)
    threading.Timer(0.2, gate.set).start()
    read.cancel()  # returns once the queued READ has run (and refused to start)
    with pytest.raises(KVTransferFailed, match="cancelled before it started"):
        read.check()
    assert not any(t[DST_IDS].view(torch.int16).any() for t in flat_caches(rx.caches))

    async def cancel_mid_read():
        task = asyncio.create_task(rx.agent.read_blocks(peer, src_ids, DST_IDS, timeout=5.0))
        await asyncio.sleep(0)  # it starts
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await rx.agent.read_blocks(peer, src_ids, DST_IDS, timeout=5.0)

    assert asyncio.run(cancel_mid_read()) > 0
    for s, d in zip(flat_caches(make_caches("mha", NUM_BLOCKS)), flat_caches(rx.caches)):
        assert same_bytes(s[src_ids], d[DST_IDS])


def test_a_read_dropped_before_its_turn_checks_as_failed():
    """A READ whose future was cancelled before the agent's thread took it (an awaiting
    caller went away) is a failed READ to whoever polls it, not an escaping CancelledError."""
    from tandem.workers.kv.transport import KVTransferFailed

    future: concurrent.futures.Future = concurrent.futures.Future()
    future.cancel()
    read = nixl_backend.PostedRead(future, threading.Event(), 0)
    with pytest.raises(KVTransferFailed, match="cancelled before it started"):
        read.check()
    read.cancel()  # already over: returns at once


def test_block_runs_merge_consecutive_ids_on_both_sides():
    runs = block_runs([4, 5, 6, 9, 10, 11, 2], [0, 1, 2, 3, 7, 8, 9])
    assert runs.tolist() == [[4, 0, 3], [9, 3, 1], [10, 7, 2], [2, 9, 1]]
    assert block_runs([4, 5], [0, 1], merge=False).tolist() == [[4, 0, 1], [5, 1, 1]]
    assert block_runs([], []).shape == (0, 3)


def test_block_major_tensors_read_as_one_descriptor_per_run():
    """The runner's block-major cache: the tensors of a block are one range, so a run of
    blocks is one descriptor; anything else keeps one descriptor per tensor and run."""
    stack = torch.zeros(6, 4, 8, dtype=torch.bfloat16)  # [blocks, tensors, block]
    tensors = [nixl_backend.tensor_blocks(stack[:, i]) for i in range(4)]
    whole = nixl_backend.whole_blocks(tensors)
    assert whole == TensorBlocks(stack.data_ptr(), 64, 64, 6, 0)
    rows = descriptor_rows([whole], np.array([1, 4]), np.array([2, 1]))
    assert rows.tolist() == [[stack.data_ptr() + 64, 128, 0], [stack.data_ptr() + 256, 64, 0]]
    assert nixl_backend.whole_blocks(tensors[:3]) is None  # does not fill the block
    assert nixl_backend.whole_blocks([tensors[1], tensors[0]]) is None  # out of order
    layer_major = torch.zeros(4, 6, 8, dtype=torch.bfloat16)
    assert nixl_backend.whole_blocks(
        [nixl_backend.tensor_blocks(layer_major[i]) for i in range(4)]) is None


def test_descriptor_rows_cover_each_run_of_each_tensor():
    tensors = [TensorBlocks(1000, 64, 64, 10, 0), TensorBlocks(5000, 16, 16, 10, 1)]
    rows = descriptor_rows(tensors, np.array([0, 7]), np.array([3, 1]))
    assert rows.dtype == np.uint64
    assert rows.tolist() == [[1000, 192, 0], [1448, 64, 0], [5000, 48, 1], [5112, 16, 1]]
    padded = [TensorBlocks(1000, 64, 48, 10, 0)]  # blocks 48 bytes every 64: one per row
    assert descriptor_rows(padded, np.array([2, 3]), np.array([1, 1])).tolist() == [
        [1128, 48, 0], [1192, 48, 0]]


def test_registration_joins_a_stack_and_keeps_separate_storages_apart():
    stack = [TensorBlocks(400, 100, 100, 4, 0), TensorBlocks(0, 100, 100, 4, 0)]
    assert registration_regions(stack, [7, 7]) == [(0, 800, 0)]
    # adjacent in memory but separate allocations: one region each
    apart = [TensorBlocks(0, 100, 100, 4, 0), TensorBlocks(400, 100, 100, 4, 0),
             TensorBlocks(0, 100, 60, 4, 1)]
    assert registration_regions(apart, [1, 2, 1]) == [(0, 400, 0), (400, 400, 0),
                                                      (0, 360, 1)]
