"""The TP cuda-ipc copy protocol (workers/kv/ipc_ranks.py, driven by KV rank ops) with real CUDA
IPC copies: two rank processes (on cuda:0 and cuda:1, or both on cuda:0 with one GPU), each the
other's source, over a real gloo group.

* A posted copy, polled until settled, lands every rank's blocks bit for bit (block-major
  caches, as ModelRunner allocates them), and no rank keeps the copy afterwards.
* When one rank cannot copy (its slot maps nothing), the group settles as failed on that
  rank alone, the other rank's copy is waited out (none left in flight), and the group stays
  in step for the next command.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from helpers.rank_processes import run_ranks

from tandem.common.kv_exports import (CudaIpcEndpoint, CudaIpcExport,
                                      cuda_ipc_cache_from_bytes, to_bytes)
from tandem.common.kv_layout import KVLayout
from tandem.workers.kv import cuda_ipc
from tandem.workers.kv.ipc_ranks import RankIpcPeers
from tandem.workers.kv.rank_ops import AddPeer, Load, Poll, RankKV
from tandem.workers.parallel.control_gathers import all_gather_bytes, failed_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
WORLD = 2
BLOCKS, LAYERS = 48, 3
SRC_IDS, DST_IDS = [5, 17, 40, 2, 3], [30, 1, 8, 9, 44]


def rank_main(rank: int, init_file: str, out_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    try:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        torch.manual_seed(rank)
        # Block-major like ModelRunner: [blocks, tensors, block], tensor i = stack[:, i].
        source = torch.randn(BLOCKS, 2 * LAYERS, 16, 2, 64, device=device,
                             dtype=torch.bfloat16)
        caches = [(source[:, 2 * i], source[:, 2 * i + 1]) for i in range(LAYERS)]
        dest = torch.zeros_like(source)
        dest_caches = [(dest[:, 2 * i], dest[:, 2 * i + 1]) for i in range(LAYERS)]
        exports = all_gather_bytes(to_bytes(cuda_ipc.export_rank_cache(caches)), None)
        # ranks[r] = the other rank's cache: rank r maps ranks[r], so each copies its peer's.
        layout = KVLayout.from_kv_caches(caches, tp_rank=0, tp_size=WORLD)
        response = CudaIpcExport(
            endpoint=CudaIpcEndpoint("", "", ""), layout=layout,
            ranks=tuple(cuda_ipc_cache_from_bytes(exports[1 - r]) for r in range(WORLD)))
        ipc = RankIpcPeers(dest_caches, device, rank)
        ranks = RankKV(dest_caches, device, rank, WORLD)
        ranks.connectors["cuda-ipc"] = ipc

        def run(op):
            return ranks.run([op], None)[0]

        results = {"map": run(AddPeer("cuda-ipc", 0, to_bytes(response)))}

        outcome = run(Load("cuda-ipc", 1, 0, SRC_IDS, DST_IDS, 0.0))
        while not outcome.settled:
            outcome = run(Poll("cuda-ipc", 1))
        results["copy"] = outcome.statuses
        mine = source[SRC_IDS].view(torch.int16).flatten().cpu().int()  # bits; gloo: no int16
        sources = [torch.empty_like(mine) for _ in range(WORLD)]
        dist.all_gather(sources, mine)
        landed = dest[DST_IDS].view(torch.int16).flatten().cpu().int()
        results["bit_exact"] = bool(torch.equal(landed, sources[1 - rank]))
        results["untouched"] = bool(
            dest[[b for b in range(BLOCKS) if b not in DST_IDS]].count_nonzero() == 0)

        # Rank 1 copies from a slot it never mapped: failed there, rank 0's copy waited out.
        slot = 0 if rank == 0 else 7
        results["one_failed"] = run(Load("cuda-ipc", 2, slot, SRC_IDS, [0, 6, 7, 10, 11],
                                         0.0)).statuses
        results["in_flight"] = ipc.copies_in_flight
        results["after"] = failed_ranks(True, None)  # still in step
        with open(out_path, "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def test_rank_copies_land_bit_exactly_and_a_one_rank_failure_settles_everywhere(tmp_path):
    results = run_ranks(rank_main, tmp_path, WORLD, timeout=180)
    for got in results:
        assert got["map"] == []
        assert got["copy"] == [1, 1]  # DONE on both
        assert got["bit_exact"] and got["untouched"]
        assert got["one_failed"][1] == 2  # FAILED on rank 1 (rank 0: done or pending)
        assert got["in_flight"] == 0
        assert got["after"] == []
