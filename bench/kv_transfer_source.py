"""The source side of bench/kv_transfer.py: a prefill worker's KV transfer service without
its engine. Random caches shaped as ModelRunner allocates them, pinned handles, and the real
KVTransferServicer on 127.0.0.1, in a spawned process (`source_main`).

PinnedHandlesEngine is the stand-in for the engine: the AsyncEngine methods the KVTransfer
servicer calls (renew_kv_lease, release_kv, kv_lease_seconds). Tests that run a real servicer
use it too.
"""
from __future__ import annotations

import asyncio

import torch

CPU_FILL_SEED = 1234


class PinnedHandlesEngine:
    """handle id -> its pinned source blocks, pinned until released (no lease expiry)."""

    def __init__(self, handles: dict[str, list[int]], lease_seconds: float = 30.0) -> None:
        self.pinned = {h: list(ids) for h, ids in handles.items()}
        self.kv_lease_seconds = lease_seconds

    async def renew_kv_lease(self, handle_id: str) -> list[int] | None:
        blocks = self.pinned.get(handle_id)
        return None if blocks is None else list(blocks)

    async def release_kv(self, handle_id: str) -> bool:
        return self.pinned.pop(handle_id, None) is not None


def ends(args) -> tuple[str, str]:
    """(source device, destination device)."""
    return ("cpu", "cpu") if args.device == "cpu" else ("cuda:0", "cuda:1")


def make_caches(args, num_blocks: int, device: str):
    """Caches laid out as ModelRunner allocates them: views of one block-major tensor
    [blocks, layers * 2, block] (a block of every layer contiguous)."""
    dtype = getattr(torch, args.dtype)
    stack = torch.empty((num_blocks, args.layers * 2, args.block_size, args.kv_heads,
                         args.head_dim), dtype=dtype, device=device)
    return [(stack[:, 2 * i], stack[:, 2 * i + 1]) for i in range(args.layers)], stack


def fill_random_bits(stack: torch.Tensor) -> None:
    """Random bit patterns (NaNs and infinities included); on CPU from a fixed seed, so the
    measuring process can rebuild the source's bytes for its check."""
    bits = stack.view(torch.int16)
    if stack.device.type == "cpu":
        bits.random_(-2**15, 2**15, generator=torch.Generator().manual_seed(CPU_FILL_SEED))
    else:
        bits.random_(-2**15, 2**15)


def source_main(args, num_blocks: int, handles: dict, queue, stop) -> None:
    """The prefill side: random caches, pinned handles, the real KVTransferServicer."""
    import grpc

    from tandem.v1 import worker_pb2_grpc
    from tandem.workers.kv.block_access import DirectKVBlocks
    from tandem.workers.kv_transfer_service import KVTransferServicer
    from tandem.common.kv_layout import KVLayout

    device = ends(args)[0]
    if device != "cpu":
        torch.cuda.set_device(0)
    caches, stack = make_caches(args, num_blocks, device)
    fill_random_bits(stack)
    layout = KVLayout.from_kv_caches(caches)
    exporter, nixl_agent = None, None
    if device != "cpu":
        from tandem.workers.kv.cuda_ipc import CudaIpcExporter

        torch.cuda.synchronize()
        exporter = CudaIpcExporter(caches, layout)
    if "nixl" in args.backends.split(","):
        from tandem.workers.kv.nixl_backend import NixlKVAgent

        nixl_agent = NixlKVAgent(caches, layout)
    engine = PinnedHandlesEngine(handles, lease_seconds=3600.0)

    async def serve():
        server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20),
                                          ("grpc.max_receive_message_length", 64 << 20)])
        worker_pb2_grpc.add_KVTransferServicer_to_server(
            KVTransferServicer(engine, layout, DirectKVBlocks(caches), exporter, nixl_agent),
            server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        queue.put(port)
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await server.stop(1)

    asyncio.run(serve())
