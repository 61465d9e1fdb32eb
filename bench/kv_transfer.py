"""KV transfer between two GPUs of one host, each backend against the plain copy rate.

    python -m tandem.bench.kv_transfer [--blocks 1,2,4,...,128] [--iters 20] [--out r.json]
    python -m tandem.bench.kv_transfer --device cpu --layers 4 --kv-heads 2 --head-dim 64 \\
        --block-size 4 --blocks 1,3,7 [--backends grpc,nixl]   # host caches end to end (no GPU)

1. The plain copy rate: one large tensor cuda:0 -> cuda:1 (CUDA events, warm-up, median), the
   ceiling every backend is compared with (--device cpu: a host memcpy).
2. A source process (kv_transfer_source.py) holds a KV cache on cuda:0 (Llama-8B-shaped by
   default: 32 layers, 8 KV heads, head 128, block 16, bf16: 2 MiB per block over all layers,
   K and V) and serves the real KVTransferServicer on 127.0.0.1 with pinned handles of 1..128
   scattered blocks. This process pulls them into scattered blocks of a cache on cuda:1:
     grpc           pull_kv: iter_payload_chunks -> gRPC stream -> PayloadWriter (host staging)
     cuda-ipc       KVReceiver.pull of a handle that names its blocks and lease deadline (as a
                    prefill worker's handles do): the one-pass GPU-to-GPU gather, no RPC
     cuda-ipc-lease the same pull of a handle without them: a LeaseKV RPC first
     cuda-ipc-copy  BlockCopier.copy alone (CUDA events): the data path
     nixl           KVReceiver.pull: LeaseKV RPC + one NIXL READ of the leased blocks (VRAM
                    descriptors on GPU, DRAM on CPU; the source agent is loaded once, untimed)
   Then `--concurrency` N pullers of one size at once, each pulling again as soon as its last
   pull landed, for STREAM_WINDOW_SECONDS per timed sample (cuda-ipc xN rows, sizes whose N
   copies fit in the destination cache): how fast a loaded decode worker drains handles. Pulls
   of one event-loop turn share a launch; the next launch is queued while the GPU copies. Its
   ms column is the window over the pulls in it (per handle, amortized), its GB/s throughput.
   The first pull of each backend and size lands on zeroed blocks and is checked bit for bit
   against the source's blocks (on GPU read through the source's mapped cache; on CPU against
   the same seeded fill). Then --warmup untimed pulls (1 once a pull takes over 0.25 s) and
   up to --iters timed ones; a cell stops after --cell-seconds, keeping at least 3 timed
   pulls. The table (last) gives per backend and handle size the median and p90 latency, GB/s
   and the ratio to the copy rate, and the ratio to the same-size copy: one contiguous copy of
   the row's bytes timed as a pull is. That is the fair peer of small handles, because even
   the copy engine is latency-bound there: on 2 H200s a 2 MiB copy runs at 0.23x the 1 GiB
   rate, 8 MiB at 0.52x, 32 MiB at 0.81x (bench/probes/kv_gather_anatomy.py).

The caches hold random bit patterns, so some elements are NaNs (about 1 in 256 in bf16): the
check compares bytes, never values (torch.equal is False on NaN == NaN). Comparing values was
why this bench reported "grpc: bytes differ" although every byte had arrived.
Exits 2 without two CUDA GPUs (unless --device cpu), 1 when a check fails. The nixl row needs
the tandem[nixl] extra: --backends grpc,cuda-ipc,cuda-ipc-copy,nixl. The default run is
sized for under 90 s on 2 H200s (each backend x size cell is capped by --cell-seconds; the
slowest, grpc at 128 blocks, moves 256 MiB per pull). Smaller handles: --block-size 1.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import statistics
import sys
import time
import torch

from tandem.bench.kv_transfer_source import ends, fill_random_bits, make_caches, source_main

STREAM_WINDOW_SECONDS = 0.2


class CheckFailed(AssertionError):
    """A pulled handle's bytes differ from the source's."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.kv_transfer",
                                description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: cuda:0 -> cuda:1 (default); cpu: both ends on the host (grpc, "
                        "nixl)")
    p.add_argument("--blocks", default="1,2,4,8,16,32,64,128",
                   help="handle sizes in blocks (comma separated)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backends",
                   help="default grpc,cuda-ipc,cuda-ipc-lease,cuda-ipc-copy (cpu: grpc); add "
                        "nixl with the tandem[nixl] extra")
    p.add_argument("--concurrency", type=int, default=8,
                   help="handles pulled at once for the cuda-ipc xN rows (1: none)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cell-seconds", type=float, default=4.0,
                   help="stop timing one backend x size after this long (>= 3 timed pulls)")
    p.add_argument("--copy-mib", type=int, default=1024, help="size of the plain copy")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    from tandem.workers.kv.nixl_agent import is_installed

    if args.backends is None:
        args.backends = ("grpc" if args.device == "cpu"
                         else "grpc,cuda-ipc,cuda-ipc-lease,cuda-ipc-copy")
    backends = args.backends.split(",")
    known = ("grpc", "nixl") if args.device == "cpu" else (
        "grpc", "cuda-ipc", "cuda-ipc-lease", "cuda-ipc-copy", "nixl")
    unknown = [b for b in backends if b not in known]
    if unknown:
        p.error(f"--backends {unknown[0]!r} is not one of {', '.join(known)} on "
                f"--device {args.device}" + (" (cuda-ipc needs CUDA)" if args.device == "cpu"
                                             else ""))
    if "nixl" in backends and not is_installed():
        p.error("--backends nixl needs NIXL: pip install 'tandem[nixl]'")
    return args


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN payloads included), whatever the dtype."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def copy_rate(args, num_bytes: int) -> float:
    """Bytes/s of one tensor copy source -> destination device (median, after warmup): CUDA
    events on the GPU, so no host latency counts."""
    src, dst = copy_buffers(args, num_bytes)
    times = []
    for i in range(args.warmup + args.iters):
        if args.device == "cpu":
            started = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - started
        else:
            with torch.cuda.device(1):
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        if i >= args.warmup:
            times.append(seconds)
    assert torch.equal(dst[:4096].cpu(), src[:4096].cpu())
    return num_bytes / statistics.median(times)


def copy_buffers(args, num_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    src_dev, dst_dev = ends(args)
    src = torch.empty(num_bytes, dtype=torch.uint8, device=src_dev).random_(0, 255)
    return src, torch.empty(num_bytes, dtype=torch.uint8, device=dst_dev)


def same_size_copy_seconds(args, num_bytes: int, count: int) -> float:
    """The peer of a pull row: `count` contiguous copies of num_bytes source -> destination
    device queued back to back, timed as pulls are (host clock, from the first call until the
    last copy completed), per copy; median of --iters after --warmup."""
    src, dst = copy_buffers(args, num_bytes)
    times = []
    with torch.cuda.device(1) if args.device != "cpu" else contextlib.nullcontext():
        for i in range(args.warmup + args.iters):
            if args.device != "cpu":
                torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(count):
                dst.copy_(src, non_blocking=args.device != "cpu")
            if args.device != "cpu":
                torch.cuda.current_stream().synchronize()
            if i >= args.warmup:
                times.append((time.perf_counter() - started) / count)
    return statistics.median(times)


async def measure(args, address: str, handles: dict, sizes: list[int], rate: float,
                  num_source_blocks: int) -> list:
    import grpc

    from tandem.common.kv_exports import KVHandle
    from tandem.common.kv_layout import KVLayout
    from tandem.workers.kv import cuda_ipc
    from tandem.workers.kv.block_access import DirectKVBlocks
    from tandem.workers.kv.receiver import KVReceiver
    from tandem.workers.kv_transfer_service import KVPeerClient, pull_kv

    on_gpu = args.device != "cpu"
    device = torch.device(ends(args)[1])  # the current device here (main scopes it)
    local_blocks = max(sizes) * 2 + 1
    caches, _ = make_caches(args, local_blocks, str(device))
    layout = KVLayout.from_kv_caches(caches)
    channel = grpc.aio.insecure_channel(address, options=[
        ("grpc.max_receive_message_length", 64 << 20)])
    peer = KVPeerClient(channel, layout)
    flat = cuda_ipc.flat_caches(caches)
    endpoint, receiver, check_peer, copier = None, None, None, None
    nixl_endpoint, nixl_receiver = None, None
    if "nixl" in args.backends.split(","):
        from tandem.workers.kv.nixl_backend import NixlKVAgent

        nixl_endpoint = (await peer.export_nixl(None)).endpoint
        nixl_receiver = KVReceiver("nixl", layout, DirectKVBlocks(caches), caches, device, 1,
                                   NixlKVAgent(caches, layout))
    if on_gpu:
        export = await peer.export_cuda_ipc(None)
        endpoint = export.endpoint
        check_peer = cuda_ipc.open_peer(export, device)  # the source's bytes, for the checks
        source_flat = check_peer.caches
        receiver = KVReceiver("cuda-ipc", layout, DirectKVBlocks(caches), caches, device, 1)
        copier = cuda_ipc.BlockCopier(check_peer.caches, flat)
    else:  # the source filled its cache from CPU_FILL_SEED: rebuild the same bytes here
        source_caches, source_stack = make_caches(args, num_source_blocks, "cpu")
        fill_random_bits(source_stack)
        source_flat = cuda_ipc.flat_caches(source_caches)

    def sync():
        if on_gpu:
            torch.cuda.synchronize(device)

    def handle_for(backend: str, n: int) -> KVHandle:
        cuda_ipc_endpoint = endpoint
        if backend == "cuda-ipc":  # as a prefill worker's handle: its blocks and lease
            cuda_ipc_endpoint = dataclasses.replace(
                endpoint, block_ids=tuple(handles[f"h{n}"]),
                lease_deadline_monotonic=time.monotonic() + 3600)
        return KVHandle(
            handle_id=f"h{n}", num_blocks=n,
            transports=tuple((["cuda-ipc"] if on_gpu else [])
                             + (["nixl"] if nixl_endpoint else []) + ["grpc"]),
            cuda_ipc=cuda_ipc_endpoint, nixl=nixl_endpoint)

    async def pull(backend: str, n: int, dst_sets: list[list[int]]) -> float:
        """Seconds for pulling the n-block handle into each of dst_sets at once."""
        src_ids = handles[f"h{n}"]
        sync()
        if backend == "cuda-ipc-copy":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            copier.copy(src_ids, dst_sets[0])
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        handle = handle_for(backend, n)
        started = time.perf_counter()
        if backend == "grpc":
            await pull_kv(channel, handle, layout, DirectKVBlocks(caches), dst_sets[0], 0,
                          timeout=600)
        elif len(dst_sets) == 1:
            pulling = nixl_receiver if backend == "nixl" else receiver
            _, used = await pulling.pull(peer, address, handle, dst_sets[0], 0, 600)
            assert used == backend.removesuffix("-lease"), used
        else:  # streamed: each puller pulls again as soon as its last pull landed
            stop_at, pulls = started + STREAM_WINDOW_SECONDS, []

            async def puller(dst_ids):
                while not pulls or time.perf_counter() < stop_at:
                    pulls.append((await receiver.pull(peer, address, handle, dst_ids, 0,
                                                      600))[1])

            await asyncio.gather(*(puller(dst_ids) for dst_ids in dst_sets))
            assert set(pulls) == {"cuda-ipc"}, set(pulls)
            sync()
            return (time.perf_counter() - started) / len(pulls)  # per handle, amortized
        sync()
        return time.perf_counter() - started

    def check(label: str, n: int, dst_sets: list[list[int]]) -> None:
        src_ids = handles[f"h{n}"]
        for dst_ids in dst_sets:
            for index, (s, d) in enumerate(zip(source_flat, flat)):
                if not same_bytes(s[src_ids], d[dst_ids]):
                    raise CheckFailed(f"{label}: bytes differ ({n} blocks, layer "
                                      f"{index // 2}, {'KV'[index % 2]})")

    cells = [(backend, n, [list(range(local_blocks - 1, local_blocks - 1 - 2 * n, -2))])
             for n in sizes for backend in args.backends.split(",")]
    c = args.concurrency
    if on_gpu and c > 1 and "cuda-ipc" in args.backends.split(","):
        cells += [("cuda-ipc", n, [list(range(j, c * n, c)) for j in range(c)])
                  for n in sizes if c * n <= local_blocks]
    rows = []
    same_size: dict[tuple[int, int], float] = {}  # (bytes, copies at once) -> seconds per copy
    for backend, n, dst_sets in cells:
        label = backend if len(dst_sets) == 1 else f"{backend} x{len(dst_sets)}"
        num_bytes = n * layout.bytes_per_layer_block * layout.num_layers
        times, cell_started, warmup = [], None, args.warmup
        for i in range(1 + args.warmup + args.iters):
            if i == 0:  # the first pull lands on zeroed blocks, then is checked
                for t in flat:
                    for dst_ids in dst_sets:
                        t[dst_ids] = 0
            seconds = await pull(backend, n, dst_sets)
            if i == 0:
                check(label, n, dst_sets)
                cell_started = time.perf_counter()
                if seconds > 0.25:  # a large handle: the checked pull warmed the path
                    warmup = min(warmup, 1)
            elif i > warmup:
                times.append(seconds)
                if len(times) >= 3 and time.perf_counter() - cell_started > args.cell_seconds:
                    break
        median = statistics.median(times)
        if (num_bytes, len(dst_sets)) not in same_size:
            same_size[num_bytes, len(dst_sets)] = same_size_copy_seconds(args, num_bytes,
                                                                         len(dst_sets))
        rows.append(dict(backend=label, blocks=n, bytes=num_bytes, iters=len(times),
                         latency_ms=median * 1e3,
                         p90_ms=sorted(times)[int(0.9 * (len(times) - 1))] * 1e3,
                         gbps=num_bytes / median / 1e9, ratio=num_bytes / median / rate,
                         same_size_copy_ms=same_size[num_bytes, len(dst_sets)] * 1e3,
                         ratio_same_size=same_size[num_bytes, len(dst_sets)] / median))
        print(f"  {label:16s} {n:4d} blocks {num_bytes / 2**20:8.1f} MiB "
              f"{median * 1e3:9.3f} ms {num_bytes / median / 1e9:8.2f} GB/s (bytes checked)",
              flush=True)
    receiver = check_peer = copier = nixl_receiver = None  # unmap before closing the channel
    await channel.close()
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and (not torch.cuda.is_available()
                                  or torch.cuda.device_count() < 2):
        print("kv_transfer: needs 2 CUDA GPUs on one host (torch sees "
              f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}); nothing "
              "measured (--device cpu runs the grpc path on the host)", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    started = time.monotonic()
    sizes = sorted({int(b) for b in args.blocks.split(",")})
    rate = copy_rate(args, args.copy_mib << 20)
    src_dev, dst_dev = ends(args)
    print(f"{src_dev} -> {dst_dev} copy rate: {rate / 1e9:.1f} GB/s ({args.copy_mib} MiB "
          "tensor)", flush=True)
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
        # The pulling end is the current device while measuring only: tests call main()
        # in-process and must not find a different current device afterwards.
        with torch.cuda.device(dst_dev) if args.device != "cpu" else contextlib.nullcontext():
            rows = asyncio.run(measure(args, f"127.0.0.1:{port}", handles, sizes, rate,
                                       num_blocks))
    except CheckFailed as exc:
        print(f"kv_transfer: bit-exact check failed: {exc}", file=sys.stderr)
        return 1
    finally:
        stop.set()
        source.join(30)
        if source.is_alive():
            source.kill()
    print(f"\nKV transfer {src_dev} -> {dst_dev}, {args.layers} layers x {args.kv_heads} KV "
          f"heads x {args.head_dim} head x block {args.block_size}, {args.dtype}; copy rate "
          f"{rate / 1e9:.1f} GB/s; median of up to {args.iters} pulls; every handle's bytes "
          f"checked; {time.monotonic() - started:.0f} s in all")
    print("x copy: the row's GB/s over the copy rate. same ms: one contiguous copy of the "
          "row's bytes (xN rows: N queued at once, per copy), timed as a pull is (host clock, "
          "call to completion); x same: that time over the row's")
    print(f"{'backend':16s} {'blocks':>6s} {'MiB':>8s} {'n':>3s} {'ms':>9s} {'p90 ms':>9s} "
          f"{'GB/s':>8s} {'x copy':>7s} {'same ms':>8s} {'x same':>7s}")
    for r in rows:
        print(f"{r['backend']:16s} {r['blocks']:6d} {r['bytes'] / 2**20:8.1f} {r['iters']:3d} "
              f"{r['latency_ms']:9.3f} {r['p90_ms']:9.3f} {r['gbps']:8.2f} {r['ratio']:7.3f} "
              f"{r['same_size_copy_ms']:8.3f} {r['ratio_same_size']:7.3f}")
    if args.out:
        name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), copy_rate_gbps=rate / 1e9, device=name,
                           rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
