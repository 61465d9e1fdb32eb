"""The cuda-ipc rank protocol (workers/kv/ipc_ranks.py, driven by the KV rank ops) over a real
2-process gloo group on CPU: bytes of different lengths reach every rank intact, every rank
learns which ranks failed, and a map or copy that cannot work on a rank (here: no CUDA), or a
poll of a transfer no rank holds, comes back as a reported failure with the group still in step.
Real mappings and copies between GPUs: tests/gpu/test_kv_cuda_ipc_gpu.py."""
from __future__ import annotations

import json

import torch
import torch.distributed as dist
from helpers.rank_processes import run_ranks

from tandem.common.convert import cuda_ipc_export_from_proto, layout_to_proto
from tandem.common.kv_exports import to_bytes
from tandem.common.kv_layout import KVLayout
from tandem.v1 import worker_pb2
from tandem.workers.kv.ipc_ranks import RankIpcPeers
from tandem.workers.kv.rank_ops import AddPeer, Load, Poll, RankKV, decode_ops, encode_ops
from tandem.workers.parallel.control_gathers import all_gather_bytes, failed_ranks

WORLD = 2


def unmappable_export(caches) -> worker_pb2.ExportKVCacheResponse:
    """An export whose handles no process can open (bytes that are no cudaIpcMemHandle)."""
    layout = KVLayout.from_kv_caches(caches, tp_rank=0, tp_size=WORLD)
    tensor = worker_pb2.CudaIpcTensor(storage_handle=b"not a handle", storage_size_bytes=64,
                                      shape=[2, 4, 1, 8], stride=[32, 8, 8, 1])
    rank_cache = worker_pb2.CudaIpcCache(device_uuid="GPU-none", tensors=[tensor])
    return worker_pb2.ExportKVCacheResponse(
        endpoint=worker_pb2.CudaIpcEndpoint(export_id="e1"), layout=layout_to_proto(layout),
        ranks=[rank_cache] * WORLD)


def rank_main(rank: int, init_file: str, out_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    try:
        caches = [(torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8))]
        results = {"gathered": [b.hex() for b in all_gather_bytes(
            bytes([rank]) * (11 * rank + 3), None)],
                   "empty": [b.hex() for b in all_gather_bytes(b"" if rank else b"ab", None)],
                   "failed": failed_ranks(rank == 0, None)}
        ipc = RankIpcPeers(caches, torch.device("cuda", 0), rank)
        ranks = RankKV(caches, torch.device("cuda", 0), rank, WORLD)
        ranks.connectors["cuda-ipc"] = ipc  # Setup would export the cache: no CUDA here
        export = cuda_ipc_export_from_proto(unmappable_export(caches))
        ops = [AddPeer("cuda-ipc", 3, to_bytes(export)),
               Load("cuda-ipc", 9, 3, [0, 1], [1, 0], 0.0),
               Poll("cuda-ipc", 9), Poll("cuda-ipc", 4, True)]
        if rank == 1:  # the follower's side: the ops as the step broadcast carries them
            ops = decode_ops(encode_ops(ops))
        answers = ranks.run(ops, None)
        if rank == 0:
            results["map"] = answers[0]
            results["copy"], results["poll"], results["finish"] = (
                outcome.statuses for outcome in answers[1:])
        results["in_flight"] = ipc.copies_in_flight
        results["after"] = failed_ranks(True, None)  # still in step
        with open(out_path, "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def test_rank_protocol_reports_failures_and_stays_in_step(tmp_path):
    results = run_ranks(rank_main, tmp_path, WORLD)
    for got in results:
        assert got["gathered"] == [(bytes([0]) * 3).hex(), (bytes([1]) * 14).hex()]
        assert got["empty"] == [b"ab".hex(), ""]
        assert got["failed"] == [1]
        assert got["after"] == []
        assert got["in_flight"] == 0
    # No rank can map the export (no CUDA here), so a copy from the slot it left empty fails on
    # both ranks (FAILED = 2), and so do polls of a transfer no rank holds, finishing or not.
    assert results[0]["map"] == [0, 1]
    assert results[0]["copy"] == [2, 2]
    assert results[0]["poll"] == [2, 2]
    assert results[0]["finish"] == [2, 2]

