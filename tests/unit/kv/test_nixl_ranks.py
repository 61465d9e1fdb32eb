"""The nixl rank protocol (workers/kv/nixl_ranks.py) over a real 2-process gloo group on
CPU, with real NIXL agents (UCX) over host ("DRAM") caches: every rank READs its own rank's
heads of the source (values differ by rank) into exactly the destination blocks, and a READ
from a slot never loaded or unloaded, a load of a source that exported too few rank agents,
or an out-of-range block id comes back as a reported failure of the ranks concerned, with
the group still in step; a source loaded in two slots still reads through one after the
other is unloaded. A READ is posted and then polled until settled; one that fails on one rank
settles as failed on both, a cancelled one as failed, and neither rank holds a READ after.
Every rank runs the KV rank ops (workers/kv/rank_ops.py) as the executor does; rank 1 runs
them as the step broadcast carries them (encoded, then decoded)."""
from __future__ import annotations

import dataclasses
import itertools
import json
import time

import pytest
import torch
import torch.distributed as dist
from helpers.rank_processes import run_ranks

from tandem.common.kv_exports import NixlAgentExport, to_bytes
from tandem.common.kv_layout import KVLayout
from tandem.workers.kv.nixl_agent import is_installed
from tandem.workers.kv.nixl_ranks import NixlUnavailable, RankNixl, merge_rank_exports
from tandem.workers.kv.rank_connector import pack_rank_exports
from tandem.workers.kv.rank_ops import (AddPeer, Load, Poll, RankKV, RemovePeer, Setup,
                                        decode_ops, encode_ops)
from tandem.workers.parallel.control_gathers import all_gather_bytes, failed_ranks

if not is_installed():
    pytest.skip("nixl is an optional extra (pip install 'tandem[nixl]')",
                allow_module_level=True)

WORLD = 2
SHAPE = (6, 4, 1, 8)  # [num_blocks, block_size, kv_heads, head_dim]
SRC_IDS, DST_IDS = [1, 2, 5], [0, 3, 4]
TIMEOUT = 10.0


def source_caches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One layer's K and V, every value telling the rank, the tensor and the block."""
    numel = torch.Size(SHAPE).numel()
    k = torch.arange(numel, dtype=torch.float32).view(SHAPE) + 1000 * rank
    return [(k, -k - 1)]


def rank_main(rank: int, init_file: str, out_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    source = receiver = None
    try:
        src_caches = source_caches(rank)
        dst_caches = [(torch.zeros(SHAPE), torch.zeros(SHAPE))]
        layout = KVLayout.from_kv_caches(src_caches, tp_rank=0, tp_size=WORLD)
        source = RankNixl(src_caches, torch.device("cpu"), rank)
        receiver = RankKV(dst_caches, torch.device("cpu"), rank, WORLD)

        def run(op):
            """Rank 0 runs the op as the executor does; rank 1 as the STEP carries it."""
            ops = [op] if rank == 0 else decode_ops(encode_ops([op]))
            return receiver.run(ops, None)[0]

        mine = source.setup(layout)
        results = {"receiver_export": bool(run(Setup("nixl", layout))[rank])}
        exports = all_gather_bytes(mine, None)
        merged = merge_rank_exports(exports)
        results["ranks"] = len(merged.ranks)
        try:
            merge_rank_exports([exports[0], b""])
            results["merge_missing"] = "no error"
        except NixlUnavailable as exc:
            results["merge_missing"] = str(exc)
        short = dataclasses.replace(merged, ranks=merged.ranks[:1])

        def load(slot: int, export: NixlAgentExport):
            return run(AddPeer("nixl", slot,
                               pack_rank_exports([to_bytes(r) for r in export.ranks])))

        transfers = itertools.count()

        def read(slot: int, src_ids: list[int], dst_ids: list[int], slot_on_rank1=None):
            """As RankGroupNixl.read: load, then poll until settled; the failed ranks."""
            transfer = next(transfers)
            slot_here = slot if rank == 0 or slot_on_rank1 is None else slot_on_rank1
            outcome = run(Load("nixl", transfer, slot_here, src_ids, dst_ids, TIMEOUT))
            while not outcome.settled:
                time.sleep(1e-4)
                outcome = run(Poll("nixl", transfer))
            results.setdefault("outcomes", []).append(outcome.statuses)
            return outcome.failed

        def cancelled(src_ids: list[int], dst_ids: list[int]):
            """Started, then finished at once: whatever the READ had reached, both ranks
            settle it as failed and hold nothing."""
            transfer = next(transfers)
            run(Load("nixl", transfer, 0, src_ids, dst_ids, TIMEOUT))
            return run(Poll("nixl", transfer, True)).failed

        def unload(slot: int) -> None:  # no collective
            run(RemovePeer("nixl", slot))

        started = time.monotonic()
        results["load"] = load(0, merged)
        results["read"] = read(0, SRC_IDS, DST_IDS)
        results["read_s"] = time.monotonic() - started
        other = source_caches(1 - rank)
        untouched = [b for b in range(SHAPE[0]) if b not in DST_IDS]
        results["own_blocks"] = all(torch.equal(got[DST_IDS], want[SRC_IDS])
                                    for got, want in zip(dst_caches[0], src_caches[0]))
        results["other_rank_blocks"] = any(torch.equal(got[DST_IDS], want[SRC_IDS])
                                           for got, want in zip(dst_caches[0], other[0]))
        results["untouched_zero"] = all(not got[untouched].any() for got in dst_caches[0])
        results["source_unchanged"] = all(
            torch.equal(got, want) for got, want in zip(src_caches[0], source_caches(rank)[0]))

        results["read_unloaded"] = read(7, [0], [0])
        results["after_unloaded"] = failed_ranks(True, None)
        results["load_short"] = load(1, short)
        # The same source in another slot, then unloaded: slot 0 still reads through it
        # (NIXL keeps one copy of a peer's metadata; the agent counts who uses it).
        results["load_again"] = load(2, merged)
        unload(2)
        results["read_after_other_unload"] = read(0, SRC_IDS, DST_IDS)
        unload(0)
        results["read_after_unload"] = read(0, [0], [1])
        results["reload"] = load(0, merged)
        results["read_bad_dst"] = read(0, [0], [99])
        results["read_bad_src"] = read(0, [99], [1])
        results["untouched_after_failures"] = all(not got[untouched].any()
                                                  for got in dst_caches[0])
        results["read_reloaded"] = read(0, [3], [5])  # the re-loaded slot still reads
        # Rank 1 reads from a slot it never loaded: its failure settles rank 0's READ too.
        results["read_one_rank_fails"] = read(0, [4], [2], slot_on_rank1=7)
        results["cancel"] = cancelled([0, 1], [0, 1])
        results["poll_unknown"] = run(Poll("nixl", 999)).failed
        results["in_flight"] = receiver.connectors["nixl"].reads_in_flight
        results["reloaded_blocks"] = all(torch.equal(got[5], want[3])
                                         for got, want in zip(dst_caches[0], src_caches[0]))
        results["after"] = failed_ranks(True, None)  # still in step
        with open(out_path, "w") as f:
            json.dump(results, f)
    finally:
        for end in (receiver, source):
            if end is not None:
                end.close()
        dist.destroy_process_group()


def test_nixl_rank_protocol_reads_each_ranks_heads_and_reports_failures(tmp_path):
    results = run_ranks(rank_main, tmp_path, WORLD)
    for got in results:
        assert got["receiver_export"]
        assert got["ranks"] == WORLD
        assert "NIXL" in got["merge_missing"] and "[1]" in got["merge_missing"]
        # Each rank's receiver holds its own rank's source blocks, nobody else's, and no
        # other block was written, by the good READs or the failed ones.
        assert got["own_blocks"]
        assert not got["other_rank_blocks"]
        assert got["untouched_zero"]
        assert got["source_unchanged"]
        assert got["untouched_after_failures"]
        assert got["reloaded_blocks"]
        assert got["after_unloaded"] == []
        assert got["after"] == []
        assert got["in_flight"] == 0  # every posted READ settled, on both ranks
        # both ranks saw the same statuses for every READ
        assert got["outcomes"] == results[0]["outcomes"]
    leader = results[0]
    assert leader["load"] == []
    assert leader["read"] == []
    assert leader["read_unloaded"] == [0, 1]  # slot 7 was never loaded
    assert leader["load_short"] == [1]  # the source exported rank 0's agent only
    assert leader["read_after_unload"] == [0, 1]
    assert leader["load_again"] == [] and leader["read_after_other_unload"] == []
    assert leader["reload"] == []
    assert leader["read_bad_dst"] == [0, 1]
    assert leader["read_bad_src"] == [0, 1]
    assert leader["read_reloaded"] == []
    assert leader["read_one_rank_fails"] == [1]
    assert leader["cancel"] == [0, 1]
    assert leader["poll_unknown"] == [0, 1]
    assert leader["read_s"] < 20
