"""KV transfer between two GPUs of one host, each backend against the plain copy rate.

    python -m tandem.bench.kv_transfer [--blocks 1,2,4,...,128] [--iters 20] [--out r.json]

1. The device-to-device copy rate: one large tensor cuda:0 -> cuda:1 (CUDA events, warm-up,
   median): the ceiling every backend is compared with.
2. A source process holds a KV cache on cuda:0 (Llama-8B-shaped by default: 32 layers, 8 KV
   heads, head 128, block 16, bf16: 2 MiB per block over all layers, K and V) and serves the
   real KVTransferServicer on 127.0.0.1 with pinned handles of 1..128 scattered blocks. This
   process pulls them into a cache on cuda:1:
     grpc          pull_kv: iter_payload_chunks -> gRPC stream -> PayloadWriter (host staging)
     cuda-ipc      KVReceiver.pull: LeaseKV RPC + the GPU-to-GPU copy from the mapped cache
     cuda-ipc copy copy_blocks alone (CUDA events): the data path without the lease RPC
   Each pulled handle is checked bit-exact against the source once. The table (last) gives
   median latency, GB/s and the ratio to the copy rate per backend and handle size.
Exits 2 without two CUDA GPUs. Smaller handles: --block-size 1 (128 KiB per block).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from types import SimpleNamespace

import torch

GiB = 1 << 30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.kv_transfer",
                                description=__doc__.splitlines()[0])
    p.add_argument("--blocks", default="1,2,4,8,16,32,64,128",
                   help="handle sizes in blocks (comma separated)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backends", default="grpc,cuda-ipc,cuda-ipc-copy")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--copy-mib", type=int, default=1024, help="size of the plain copy")
    p.add_argument("--out", help="write the results as JSON here")
    return p.parse_args(argv)


def copy_rate(num_bytes: int, iters: int, warmup: int) -> float:
    """Bytes/s of one tensor copy cuda:0 -> cuda:1 (median of iters, after warmup)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda:0").random_(0, 255)
    dst = torch.empty(num_bytes, dtype=torch.uint8, device="cuda:1")
    times = []
    for i in range(warmup + iters):
        with torch.cuda.device(1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    assert torch.equal(dst[:4096].cpu(), src[:4096].cpu())
    return num_bytes / statistics.median(times)


def make_caches(args, num_blocks: int, device: str):
    """Caches shaped as ModelRunner allocates them: equally spaced slices of one tensor."""
    dtype = getattr(torch, args.dtype)
    stack = torch.empty((args.layers * 2, num_blocks, args.block_size, args.kv_heads,
                         args.head_dim), dtype=dtype, device=device)
    return [(stack[2 * i], stack[2 * i + 1]) for i in range(args.layers)], stack


def source_main(args, num_blocks: int, handles: dict, queue, stop) -> None:
    """The prefill side (cuda:0): random caches, pinned handles, the real KVTransferServicer."""
    import grpc

    from tandem.v1 import worker_pb2_grpc
    from tandem.workers.kv.block_access import DirectKVBlocks
    from tandem.workers.kv.cuda_ipc import CudaIpcExporter
    from tandem.workers.kv.grpc_backend import KVTransferServicer
    from tandem.workers.kv.layout import KVLayout

    torch.cuda.set_device(0)
    caches, stack = make_caches(args, num_blocks, "cuda:0")
    stack.view(torch.int16).random_(-2**15, 2**15 - 1)
    torch.cuda.synchronize()
    layout = KVLayout.from_kv_caches(caches)
    engine_state = SimpleNamespace(
        pinned={h: float("inf") for h in handles},
        requests={h: SimpleNamespace(num_computed_tokens=len(ids) * args.block_size,
                                     block_table=ids) for h, ids in handles.items()},
        config=SimpleNamespace(block_size=args.block_size, kv_lease_seconds=3600.0))

    class Engine:  # AsyncEngine.call's contract, enough for the servicer
        async def call(self, fn):
            return fn(engine_state)

    async def serve():
        server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20),
                                          ("grpc.max_receive_message_length", 64 << 20)])
        worker_pb2_grpc.add_KVTransferServicer_to_server(
            KVTransferServicer(Engine(), layout, DirectKVBlocks(caches),
                               CudaIpcExporter(caches, layout)), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        queue.put(port)
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await server.stop(1)

    asyncio.run(serve())


async def measure(args, address: str, handles: dict, sizes: list[int], rate: float) -> list:
    import grpc

    from tandem.common.convert import layout_to_proto
    from tandem.v1 import worker_pb2, worker_pb2_grpc
    from tandem.workers.kv import cuda_ipc
    from tandem.workers.kv.block_access import DirectKVBlocks
    from tandem.workers.kv.grpc_backend import pull_kv
    from tandem.workers.kv.layout import KVLayout
    from tandem.workers.kv.receiver import KVReceiver

    device = torch.device("cuda:1")
    torch.cuda.set_device(device)
    local_blocks = max(sizes) * 2 + 1
    caches, _ = make_caches(args, local_blocks, "cuda:1")
    layout = KVLayout.from_kv_caches(caches)
    channel = grpc.aio.insecure_channel(address, options=[
        ("grpc.max_receive_message_length", 64 << 20)])
    stub = worker_pb2_grpc.KVTransferStub(channel)
    export = await stub.ExportKVCache(worker_pb2.ExportKVCacheRequest(
        expected_layout=layout_to_proto(layout)))
    check_peer = cuda_ipc.open_peer(export, device)  # the source's bytes, for the checks
    receiver = KVReceiver("cuda-ipc", layout, DirectKVBlocks(caches), caches, device, 1)
    flat = cuda_ipc.flat_caches(caches)
    stacked = cuda_ipc.stacked_view(flat)
    rows = []
    for n in sizes:
        handle = worker_pb2.KVHandle(
            handle_id=f"h{n}", backend="grpc", source_address=address,
            layout=layout_to_proto(layout), num_tokens=n * args.block_size, num_blocks=n,
            transports=["cuda-ipc", "grpc"], cuda_ipc=export.endpoint)
        dst_ids = list(range(local_blocks - 1, local_blocks - 1 - 2 * n, -2))  # scattered
        num_bytes = n * layout.bytes_per_layer_block * layout.num_layers
        for backend in args.backends.split(","):
            times = []
            for i in range(args.warmup + args.iters):
                if i == 0:  # the first pull of each backend lands on zeros, then is checked
                    for t in flat:
                        t[dst_ids] = 0
                torch.cuda.synchronize(device)
                if backend == "cuda-ipc-copy":
                    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    start.record()
                    cuda_ipc.copy_blocks(check_peer.caches, flat, handles[handle.handle_id],
                                         dst_ids, None, check_peer.stacked, stacked)
                    end.record()
                    end.synchronize()
                    seconds = start.elapsed_time(end) / 1e3
                else:
                    started = time.perf_counter()
                    if backend == "grpc":
                        await pull_kv(channel, handle, layout, DirectKVBlocks(caches), dst_ids,
                                      0, timeout=600)
                    else:
                        _, used = await receiver.pull(channel, address, handle, dst_ids, 0, 600)
                        assert used == "cuda-ipc", used
                    torch.cuda.synchronize(device)
                    seconds = time.perf_counter() - started
                if i == 0:
                    src_ids = handles[handle.handle_id]
                    for s, d in zip(check_peer.caches, flat):
                        assert torch.equal(s[src_ids], d[dst_ids]), f"{backend}: bytes differ"
                if i >= args.warmup:
                    times.append(seconds)
            median = statistics.median(times)
            rows.append(dict(backend=backend, blocks=n, bytes=num_bytes,
                             latency_ms=median * 1e3, p90_ms=sorted(times)[
                                 int(0.9 * (len(times) - 1))] * 1e3,
                             gbps=num_bytes / median / 1e9,
                             ratio=num_bytes / median / rate))
            print(f"  {backend:14s} {n:4d} blocks {num_bytes / 2**20:8.1f} MiB "
                  f"{median * 1e3:9.3f} ms {num_bytes / median / 1e9:8.1f} GB/s", flush=True)
    del receiver, check_peer
    await channel.close()
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("kv_transfer: needs 2 CUDA GPUs on one host (torch sees "
              f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}); nothing "
              "measured", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    sizes = sorted({int(b) for b in args.blocks.split(",")})
    rate = copy_rate(args.copy_mib << 20, args.iters, args.warmup)
    print(f"cuda:0 -> cuda:1 copy rate: {rate / 1e9:.1f} GB/s ({args.copy_mib} MiB tensor)")
    num_blocks = sum(sizes) * 2 + 1
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    handles, used = {}, 0
    for n in sizes:  # scattered source blocks, disjoint per handle
        handles[f"h{n}"] = order[used:used + n]
        used += n
    ctx = mp.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    source = ctx.Process(target=source_main, args=(args, num_blocks, handles, queue, stop))
    source.start()
    try:
        port = queue.get(timeout=300)
        rows = asyncio.run(measure(args, f"127.0.0.1:{port}", handles, sizes, rate))
    finally:
        stop.set()
        source.join(30)
        if source.is_alive():
            source.kill()
    print(f"\nKV transfer cuda:0 -> cuda:1, {args.layers} layers x {args.kv_heads} KV heads x "
          f"{args.head_dim} head x block {args.block_size}, {args.dtype}; copy rate "
          f"{rate / 1e9:.1f} GB/s; median of {args.iters}")
    print(f"{'backend':14s} {'blocks':>6s} {'MiB':>8s} {'ms':>9s} {'p90 ms':>9s} "
          f"{'GB/s':>8s} {'x copy':>7s}")
    for r in rows:
        print(f"{r['backend']:14s} {r['blocks']:6d} {r['bytes'] / 2**20:8.1f} "
              f"{r['latency_ms']:9.3f} {r['p90_ms']:9.3f} {r['gbps']:8.1f} {r['ratio']:7.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), copy_rate_gbps=rate / 1e9,
                           device=torch.cuda.get_device_name(0), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
