"""Where a KV pull's copy time goes between two GPUs, in one process: cuda:1 reads cuda:0
through peer access, as the cuda-ipc backend's gather reads a peer's IPC-mapped cache.

    python bench/probes/kv_gather_anatomy.py [--blocks 1,2,4,16,64,128] [--iters 30]

Caches are Llama-8B-shaped (32 layers, K and V, 8 KV heads x 128, block 16, bf16: 2 MiB per
block over all 64 cache tensors). Per handle size, each row's median of --iters:

  copy-engine   one contiguous tensor of the same bytes, dst.copy_(src) (the copy engine)
  gather        BlockGather on scattered blocks, ids read from pinned host memory (shipped)
  gather-dev    the same launch with the ids already on cuda:1
  gather-seq    pinned ids, consecutive source and destination blocks (fewer pages touched)
  copier        BlockCopier.launch + event wait: pinned-id fill + direct launch (shipped)
  coalesced     ipc_copies.CoalescedCopies.copy on an asyncio loop: the decode worker's path
                without the handle bookkeeping

gpu us: CUDA events around the work, queued behind a ~100 us sleep kernel, so the host's
launch cost is hidden and only the GPU's time counts. host us: perf_counter from the call to
the completed event (what a caller waits for). x copy: the 1 GiB copy-engine rate over the
row's rate (GB/s from gpu us, or host us where there is no gpu us).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import torch

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
SLEEP_CYCLES = 200_000  # ~100 us on a 1.98 GHz H200: the launch is queued before the GPU frees


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/probes/kv_gather_anatomy.py")
    p.add_argument("--blocks", default="1,2,4,16,64,128")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--cache-blocks", type=int, default=1024,
                   help="blocks per cache tensor on each GPU (2 MiB each over all tensors)")
    return p.parse_args(argv)


def gpu_us(work, iters: int) -> float:
    """Median GPU time of work() on the current stream, launched behind a sleep kernel."""
    times = []
    for _ in range(iters + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times[2:])


def host_us(work, iters: int) -> float:
    """Median wall time from the call of work() (which returns an event) to its completion."""
    times = []
    for _ in range(iters + 2):
        torch.cuda.synchronize()
        started = time.perf_counter()
        work().synchronize()
        times.append((time.perf_counter() - started) * 1e6)
    return statistics.median(times[2:])


def coalesced_us(copies, copier, src_ids, dst_ids, iters: int) -> float:
    """Median wall time of `await copies.copy(...)` (ipc_copies.CoalescedCopies: the launch in
    the next loop turn, then the EventWaiter's poll) on a plain asyncio loop."""
    async def run() -> float:
        times = []
        for _ in range(iters + 2):
            torch.cuda.synchronize()
            started = time.perf_counter()
            await copies.copy(copier, src_ids, dst_ids)
            times.append((time.perf_counter() - started) * 1e6)
        return statistics.median(times[2:])

    return asyncio.run(run())


def main(argv=None) -> int:
    args = parse_args(argv)
    if torch.cuda.device_count() < 2:
        print("kv_gather_anatomy needs two CUDA GPUs", file=sys.stderr)
        return 2
    from tandem.workers.kv.cuda_ipc import BlockCopier
    from tandem.workers.kv.ipc_copies import CoalescedCopies
    from tandem.workers.kv.pinned_ids import PinnedBlockIds
    from tandem.workers.ops.gpu.block_copy import BlockGather

    torch.cuda.set_device(1)
    shape = (LAYERS * 2, args.cache_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    src = torch.empty(shape, dtype=torch.bfloat16, device="cuda:0").view(torch.int16)
    src.random_(-2**15, 2**15)
    src = src.view(torch.bfloat16)
    dst = torch.zeros(shape, dtype=torch.bfloat16, device="cuda:1")
    block_bytes = src[:, 0].numel() * src.element_size()
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")
    big_dst = torch.empty_like(big, device="cuda:1")
    # torch enables peer access on a copy's first use, from the source's device to the
    # destination's: this copy lets kernels on cuda:1 read cuda:0.
    big[:16].copy_(big_dst[:16])
    rate = (1 << 30) / (gpu_us(lambda: big_dst.copy_(big, non_blocking=True), 5) / 1e6)
    gather = BlockGather(src, dst)
    copier = BlockCopier(list(src.unbind(0)), list(dst.unbind(0)))
    pinned = PinnedBlockIds()
    copies = CoalescedCopies(torch.cuda.Stream())
    generator = torch.Generator().manual_seed(0)
    rows = []
    for n in [int(b) for b in args.blocks.split(",")]:
        perm = torch.randperm(args.cache_blocks, generator=generator)
        src_ids, dst_ids = perm[:n].tolist(), perm[n:2 * n].tolist()
        ids_host = pinned.fill(src_ids, dst_ids)
        ids_dev = ids_host.to("cuda:1")
        seq_host = pinned.fill(list(range(n)), list(range(n, 2 * n)))
        flat_src = torch.empty(n * block_bytes, dtype=torch.uint8, device="cuda:0")
        flat_dst = torch.empty_like(flat_src, device="cuda:1")
        gather(ids_host)  # compiles, then direct launches
        torch.cuda.synchronize()
        num_bytes = n * block_bytes

        def copy_engine() -> torch.cuda.Event:
            flat_dst.copy_(flat_src, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            return event

        cells = {
            "copy-engine": (gpu_us(lambda: flat_dst.copy_(flat_src, non_blocking=True),
                                   args.iters), host_us(copy_engine, args.iters)),
            "gather": (gpu_us(lambda: gather(ids_host), args.iters), None),
            "gather-dev": (gpu_us(lambda: gather(ids_dev), args.iters), None),
            "gather-seq": (gpu_us(lambda: gather(seq_host), args.iters), None),
            "copier": (None, host_us(lambda: copier.launch(src_ids, dst_ids), args.iters)),
            "coalesced": (None, coalesced_us(copies, copier, src_ids, dst_ids, args.iters)),
        }
        assert torch.equal(dst[:, dst_ids[0]].view(torch.int16).cpu(),
                           src[:, src_ids[0]].view(torch.int16).cpu()), "gather: bytes differ"
        for name, (gpu, host) in cells.items():
            seconds = (gpu if gpu is not None else host) / 1e6
            rows.append((name, n, num_bytes / 2**20, gpu, host, num_bytes / seconds / rate))
        print(f"{n} blocks done", flush=True)
    print(f"\ncuda:1 reading cuda:0 (peer access, one process); 1 GiB copy-engine rate "
          f"{rate / 1e9:.1f} GB/s; {LAYERS * 2} tensors x 32 KiB per block; median of "
          f"{args.iters}")
    print(f"{'row':<12} {'blocks':>6} {'MiB':>7} {'gpu us':>9} {'host us':>9} {'x copy':>7}")
    for name, n, mib, gpu, host, ratio in rows:
        cell = lambda v: f"{v:9.1f}" if v is not None else f"{'-':>9}"  # noqa: E731
        print(f"{name:<12} {n:>6} {mib:>7.1f} {cell(gpu)} {cell(host)} {ratio:7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
