"""The whole-block decode kernel (workers/ops/gpu/block_decode.py) against the Triton split-KV
kernel, decode attention alone, and where its time goes.

    python bench/probes/block_decode.py [--shapes 1x4096,8x4096,...]
    python bench/probes/block_decode.py --timeline 1x4096

Rows are CUDA-graph replays of 20 chained calls (engine_limits.time_graphed) at Llama-8B's
heads (32 q / 8 kv, head 128, block 16), the KV rotated through copies so it comes from HBM,
as bench/engine.py times decode attention. Per shape: the Triton kernel at the engine's split
count, then the block kernel at the engine's split count (block_splits_for) and at half and a
quarter of it, with padded and unpadded slots, default and 2 stages; also with no keys
(seq_len 0: launches, prologues and the combine alone). Fractions: KV bytes / time / copy
bandwidth measured in the same run.

--timeline: one replay of the 20 chained calls with %globaltimer stamps from every CTA (the
kernels' trace buffers), printed per call relative to the first call's start: split pass
entry (first / last CTA), copies issued, PDL wait returned, last block landed, partials
stored; combine entry, wait returned, end. Steady state shows which of them overlap.
"""
from __future__ import annotations

import argparse

import torch

from tandem.bench.engine_limits import measure_limits, time_graphed
from tandem.bench.engine_ops import decode_attention_inputs
from tandem.workers.ops.gpu.block_decode import (
    block_decode_attention, block_decode_supported, block_splits_for)
from tandem.workers.ops.gpu.paged_decode import paged_decode_attention

SCALE = 128 ** -0.5
CALLS = 20


def _shape(text: str) -> tuple[int, int]:
    batch, context = map(int, text.split("x"))
    return batch, context


def sweep(batch: int, context: int, copy_bps: float) -> list[tuple[str, str, float, float]]:
    inputs = decode_attention_inputs(batch, context)
    q, caches, tables, lens = inputs.q, inputs.caches, inputs.tables, inputs.seq_lens
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    name = f"{batch}x{context}"
    rows = []

    def row(what: str, fn) -> None:
        seconds = time_graphed(fn)
        rows.append((name, what, seconds, inputs.kv_bytes / seconds / copy_bps))

    ref = paged_decode_attention(q, *caches[0], tables, lens, SCALE, num_splits=inputs.splits)
    row(f"triton, {inputs.splits} splits", lambda i: paged_decode_attention(
        q, *caches[i % len(caches)], tables, lens, SCALE, num_splits=inputs.splits))
    engine = block_splits_for(batch, context, 16, sms)
    for splits in sorted({engine, max(1, engine // 2), max(1, engine // 4)}, reverse=True):
        for padded in (True, False):
            for stages in (None, 2):
                kwargs = dict(num_splits=splits, padded=padded, stages=stages)
                out = block_decode_attention(q, *caches[0], tables, lens, SCALE, **kwargs)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                row(f"blocks, {splits} splits, {'padded' if padded else 'unpadded'}, "
                    f"stages {stages or 'max'} (err {err:.0e})",
                    lambda i, kw=kwargs: block_decode_attention(
                        q, *caches[i % len(caches)], tables, lens, SCALE, **kw))
    empty = torch.zeros_like(lens)
    row(f"blocks, {engine} splits, no keys", lambda i: block_decode_attention(
        q, *caches[i % len(caches)], tables, empty, SCALE, num_splits=engine))
    return rows


def timeline(batch: int, context: int, padded: bool = True) -> None:
    inputs = decode_attention_inputs(batch, context)
    q, caches, tables, lens = inputs.q, inputs.caches, inputs.tables, inputs.seq_lens
    splits = block_splits_for(batch, context, 16,
                              torch.cuda.get_device_properties(0).multi_processor_count)
    traces = [(torch.zeros(batch * splits, 5, dtype=torch.int64, device="cuda"),
               torch.zeros(batch * 32 * 4, 5, dtype=torch.int64, device="cuda"))
              for _ in range(CALLS)]

    def chain():
        for i in range(CALLS):
            block_decode_attention(q, *caches[i % len(caches)], tables, lens, SCALE,
                                   num_splits=splits, padded=padded, trace=traces[i])
    chain()  # build and warm outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    split_t = torch.stack([t[0] for t in traces]).double()  # [calls, CTAs, 5] ns
    comb_t = torch.stack([t[1] for t in traces]).double()[..., :3]
    origin = split_t[0, :, 0].min()
    split_t, comb_t = (split_t - origin) / 1e3, (comb_t - origin) / 1e3  # us
    layout = "padded" if padded else "unpadded"
    print(f"# {batch}x{context}, {splits} splits, {layout}: one replay of {CALLS} chained "
          "calls, us from the first call's first CTA")
    print(f"{'call':>4} | {'split in':>8} {'last in':>8} {'issued':>8} {'waited':>8} "
          f"{'landed':>8} {'stored':>8} | {'comb in':>8} {'waited':>8} {'end':>8} | period")
    for i in range(CALLS):
        s, c = split_t[i], comb_t[i]
        period = s[:, 0].min() - split_t[i - 1, :, 0].min() if i else float("nan")
        print(f"{i:4d} | {s[:, 0].min():8.2f} {s[:, 0].max():8.2f} {s[:, 1].max():8.2f} "
              f"{s[:, 2].max():8.2f} {s[:, 3].max():8.2f} {s[:, 4].max():8.2f} | "
              f"{c[:, 0].min():8.2f} {c[:, 1].max():8.2f} {c[:, 2].max():8.2f} | {period:6.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x4096,1x1024,1x16384,8x4096,8x1024,32x4096",
                        help="batch x context pairs")
    parser.add_argument("--timeline", metavar="BxC", help="trace one shape's chained calls")
    parser.add_argument("--unpadded", action="store_true", help="timeline: one copy per block")
    args = parser.parse_args(argv)
    kv = torch.empty(1, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    why_not = block_decode_supported(torch.empty(1, 32, 128, dtype=torch.bfloat16,
                                                 device="cuda"), kv, kv, 1)
    if why_not is not None:
        raise SystemExit(f"block decode kernel unavailable: {why_not}")
    if args.timeline:
        timeline(*_shape(args.timeline), padded=not args.unpadded)
        return 0
    limits = measure_limits()
    print(f"# {limits.name}, copy {limits.copy_bytes_per_s / 1e12:.2f} TB/s")
    rows = []
    for pair in args.shapes.split(","):
        rows += sweep(*_shape(pair), limits.copy_bytes_per_s)
        torch.cuda.empty_cache()
    print(f"{'shape':10s} {'kernel':58s} {'us':>8s} {'of copy':>8s}")
    for name, what, seconds, fraction in rows:
        print(f"{name:10s} {what:58s} {seconds * 1e6:8.2f} {fraction * 100:7.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
