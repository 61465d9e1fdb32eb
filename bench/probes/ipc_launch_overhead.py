"""Host cost of one cuda-ipc block copy, piece by piece (one GPU; source and destination caches
on it, since only the host side is timed here: bench/kv_transfer.py times the data path).

    python bench/probes/ipc_launch_overhead.py [--blocks 1,16,128] [--iters 2000]

Rows (median microseconds of host time per call, CPU clock):
  ids pin_memory      torch.frombuffer(array(...)).pin_memory(), the old per-launch ids
  ids pooled          PinnedBlockIds.fill + retire (its buffer's last event complete)
  gather plain        BlockGather through Triton's launcher (kernel[grid](...))
  gather direct       BlockGather calling the compiled kernel directly
  copier.launch       BlockCopier.launch: stream wait, ids, gather, event
  wait to_thread      launch, then await asyncio.to_thread(event.synchronize) (the old wait;
                      wall time, GPU copy included)
  wait thread         launch, then CoalescedCopies with EventWaiter(spin_seconds=0)
  wait poll+thread    launch, then CoalescedCopies with the default EventWaiter
Launch rows synchronize every QUEUE_DEPTH launches, outside the timed calls.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from array import array

import torch

QUEUE_DEPTH = 64  # launches queued before an untimed synchronize


def timed(fn, iters: int, sync_every: int = QUEUE_DEPTH) -> float:
    """Median microseconds of fn() over iters calls (after a warm-up)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    samples = []
    for i in range(iters):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
        if i % sync_every == sync_every - 1:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


async def timed_waits(copier, waiter, src_ids, dst_ids, stream, iters: int) -> float:
    """Median microseconds from a copy's request to its completion as the loop sees it."""
    from tandem.workers.kv.ipc_copies import CoalescedCopies

    copies = CoalescedCopies(stream, waiter) if waiter is not None else None
    samples = []
    for i in range(iters + 10):
        started = time.perf_counter()
        if copies is None:
            await asyncio.to_thread(copier.launch(src_ids, dst_ids, stream).synchronize)
        else:
            await copies.copy(copier, src_ids, dst_ids)
        if i >= 10:
            samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python bench/probes/ipc_launch_overhead.py",
                                description=__doc__.splitlines()[0])
    p.add_argument("--blocks", default="1,16,128", help="block pairs per copy")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--block-bytes", type=int, default=32768, help="per tensor (K or V)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("ipc_launch_overhead: needs a CUDA GPU", file=sys.stderr)
        return 2
    from tandem.workers.kv.cuda_ipc import BlockCopier
    from tandem.workers.kv.event_waiter import EventWaiter
    from tandem.workers.kv.pinned_ids import PinnedBlockIds

    sizes = [int(b) for b in args.blocks.split(",")]
    num_blocks = 2 * max(sizes)
    shape = (2 * args.layers, num_blocks, args.block_bytes // 2)
    src = torch.empty(shape, dtype=torch.bfloat16, device="cuda").view(torch.uint8).random_()
    dst = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    copier = BlockCopier(list(src.view(torch.bfloat16)), list(dst))
    assert copier.one_launch and copier.gathers is not None
    gather = copier.gathers[0]
    stream = torch.cuda.Stream()
    done = torch.cuda.Event()
    done.record(stream)
    rows = []
    for n in sizes:
        src_ids, dst_ids = list(range(n)), list(range(num_blocks - 1, num_blocks - 1 - n, -1))
        pool = PinnedBlockIds()
        device_ids = torch.tensor([src_ids, dst_ids], dtype=torch.int32, device="cuda")

        def pooled():
            pool.retire(pool.fill(src_ids, dst_ids), done)

        rows += [
            ("ids pin_memory", n, timed(lambda: torch.frombuffer(
                array("i", src_ids + dst_ids), dtype=torch.int32).pin_memory().view(2, n),
                args.iters)),
            ("ids pooled", n, timed(pooled, args.iters)),
            ("gather plain", n, timed(lambda: gather._plain_launch(device_ids, n, stream),
                                      args.iters)),
            ("gather direct", n, timed(lambda: gather(device_ids, stream), args.iters)),
            ("copier.launch", n, timed(lambda: copier.launch(src_ids, dst_ids, stream),
                                       args.iters)),
        ]
        waits = max(50, args.iters // 10)
        for label, waiter in [("wait to_thread", None),
                              ("wait thread", EventWaiter(spin_seconds=0)),
                              ("wait poll+thread", EventWaiter())]:
            rows.append((label, n, asyncio.run(timed_waits(copier, waiter, src_ids, dst_ids,
                                                           stream, waits))))
        torch.cuda.synchronize()
        expected = src[:, src_ids]
        assert torch.equal(dst.view(torch.uint8)[:, dst_ids], expected), "copy check failed"
    print(f"{torch.cuda.get_device_name()}: {2 * args.layers} tensors x "
          f"{args.block_bytes} B blocks, {args.iters} calls per launch row; bytes checked")
    print(f"{'row':18s} {'blocks':>6s} {'us':>9s}")
    for label, n, us in rows:
        print(f"{label:18s} {n:6d} {us:9.1f}")
    print(f"direct launches: {gather.direct_launches}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
