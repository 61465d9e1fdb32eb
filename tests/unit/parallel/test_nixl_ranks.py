"""The nixl rank protocol (workers/parallel/nixl_ranks.py) over a real 2-process gloo group on
CPU, with real NIXL agents (UCX) over host ("DRAM") caches: every rank READs its own rank's
heads of the source (values differ by rank) into exactly the destination blocks, and a READ
from a slot never loaded or unloaded, a load of a source that exported too few rank agents,
or an out-of-range block id comes back as a reported failure of the ranks concerned, with
the group still in step; a source loaded in two slots still reads through one after the
other is unloaded. Rank 0 calls RankNixl as LeaderRunner does, rank 1 replays the
headers and payloads the control channel carries (follow_nixl_command)."""
from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist
from helpers.rank_processes import run_ranks

from tandem.v1 import worker_pb2
from tandem.workers.kv.layout import KVLayout
from tandem.workers.kv.nixl_agent import is_installed
from tandem.workers.parallel.ipc_ranks import all_gather_bytes, failed_ranks
from tandem.workers.parallel.messages import Command, make_header, pack_bytes
from tandem.workers.parallel.nixl_ranks import (NixlUnavailable, RankNixl, follow_nixl_command,
                                                merge_rank_exports)

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
        source, receiver = RankNixl(src_caches, rank), RankNixl(dst_caches, rank)
        mine = source.setup(layout)
        results = {"receiver_export": bool(receiver.setup(layout))}
        exports = all_gather_bytes(mine, None)
        merged = merge_rank_exports(exports)
        results["ranks"] = len(merged.ranks)
        try:
            merge_rank_exports([exports[0], b""])
            results["merge_missing"] = "no error"
        except NixlUnavailable as exc:
            results["merge_missing"] = str(exc)
        short = worker_pb2.ExportNixlAgentResponse()
        short.CopyFrom(merged)
        del short.ranks[1:]

        def load(slot: int, response: worker_pb2.ExportNixlAgentResponse):
            if rank == 0:  # as LeaderRunner.load_kv_nixl_peer
                return failed_ranks(receiver.load(slot, response), None)
            data = response.SerializeToString()
            follow_nixl_command(receiver, Command.NIXL_LOAD,
                                make_header(Command.NIXL_LOAD, slot, len(data)),
                                pack_bytes(data), None)
            return None

        def read(slot: int, src_ids: list[int], dst_ids: list[int]):
            timeout_ms = max(1, int(TIMEOUT * 1000))
            if rank == 0:  # as LeaderRunner.read_kv_nixl
                return failed_ranks(receiver.read(slot, src_ids, dst_ids, timeout_ms / 1000),
                                    None)
            follow_nixl_command(receiver, Command.NIXL_READ,
                                make_header(Command.NIXL_READ, slot, len(src_ids), timeout_ms),
                                torch.tensor([*src_ids, *dst_ids], dtype=torch.int64), None)
            return None

        def unload(slot: int) -> None:  # as LeaderRunner.unload_kv_nixl_peer: no collective
            if rank == 0:
                receiver.unload(slot)
            else:
                follow_nixl_command(receiver, Command.NIXL_UNLOAD,
                                    make_header(Command.NIXL_UNLOAD, slot), None, None)

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
        results["reloaded_blocks"] = all(torch.equal(got[5], want[3])
                                         for got, want in zip(dst_caches[0], src_caches[0]))
        results["after"] = failed_ranks(True, None)  # still in step
        with open(out_path, "w") as f:
            json.dump(results, f)
    finally:
        for nixl in (receiver, source):
            if nixl is not None:
                nixl.close()
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
    assert leader["read_s"] < 20
