"""The cuda-ipc rank protocol (workers/parallel/ipc_ranks.py) over a real 2-process gloo group
on CPU: bytes of different lengths reach every rank intact, every rank learns which ranks
failed, and a map or copy that cannot work on a rank (here: no CUDA), or a poll of a transfer
no rank holds, comes back as a reported failure with the group still in step. Real mappings
and copies between GPUs: tests/gpu/test_kv_cuda_ipc_gpu.py."""
from __future__ import annotations

import json

import torch
import torch.distributed as dist
from helpers.rank_processes import run_ranks

from tandem.common.convert import cuda_ipc_export_from_proto, layout_to_proto
from tandem.common.kv_exports import to_bytes
from tandem.common.kv_layout import KVLayout
from tandem.v1 import worker_pb2
from tandem.workers.parallel.control_gathers import all_gather_bytes, failed_ranks
from tandem.workers.parallel.ipc_ranks import RankIpcPeers, follow_ipc_command
from tandem.workers.parallel.messages import Command, make_header, pack_bytes

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
        export = cuda_ipc_export_from_proto(unmappable_export(caches))
        data = to_bytes(export)
        ids = torch.tensor([0, 1, 1, 0], dtype=torch.int64)
        if rank == 0:  # the leader's side, as LeaderRunner.map_kv_peer / post_kv_copy / ...
            results["map"] = failed_ranks(ipc.map(3, export), None)
            results["copy"] = ipc.post(9, 3, [0, 1], [1, 0], None).statuses
            results["poll"] = ipc.poll(9, False, None).statuses
            results["finish"] = ipc.poll(4, True, None).statuses
        else:  # the follower's side, from the header and payload as the control channel has them
            follow_ipc_command(ipc, Command.IPC_MAP, make_header(Command.IPC_MAP, 3, len(data)),
                               pack_bytes(data), None)
            follow_ipc_command(ipc, Command.IPC_POST, make_header(Command.IPC_POST, 9, 3, 2),
                               ids, None)
            for transfer, finish in ((9, 0), (4, 1)):
                follow_ipc_command(ipc, Command.IPC_POLL,
                                   make_header(Command.IPC_POLL, transfer, finish), ids[:0],
                                   None)
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

