"""Sweep the launch settings of our decode-path kernels on this GPU and print the best per shape.

    python bench/probes/tune_kernels.py            # about a minute on an H100

Decode attention (split-KV): splits x tile x warps x stages at Llama-8B's heads (32 q / 8 kv,
head 128, block 16), KV rotated through copies so it is read from HBM, not L2. Times are
CUDA-graph replays (bench/engine_limits.time_graphed). The defaults in
workers/ops/gpu/paged_decode.py come from this table; rerun it on a new GPU.

    python bench/probes/tune_kernels.py --gemv     # only the fused GEMV sweep
    python bench/probes/tune_kernels.py --gemv qwen3-30b-a3b   # at that model's shapes

The fused small-batch GEMV (workers/ops/gpu/decode_gemv.py): block_n x block_k x warps x
stages at Llama-8B's four projections for one row (default_config there comes from it), or at
Qwen3-30B-A3B's batch-1 GEMVs: qkv, o, and the router that also keeps the normed row for the
experts (small_batch.norm_router).
(A split-K Triton GEMM for 1-16 rows was tried before it, without fusion: it won only on
o_proj, 15.3 vs 16.5 us on an H100, and was not kept.)
"""
from __future__ import annotations

import itertools
import sys

import torch

from tandem.bench.engine_limits import copies_to_defeat_l2, measure_limits, time_graphed
from tandem.bench.engine_ops import PROJECTIONS
from tandem.workers.ops.gpu.decode_gemv import default_config, fused_gemv
from tandem.workers.ops.gpu.paged_decode import paged_decode_attention

BF16 = torch.bfloat16


def tune_attention(copy_bps: float) -> list[str]:
    lines = []
    for batch, context in ((1, 1024), (1, 4096), (8, 4096), (64, 4096)):
        blocks = batch * context // 16
        kv_bytes = 2 * batch * context * 8 * 128 * 2
        caches = [(torch.randn(blocks, 16, 8, 128, device="cuda", dtype=BF16),
                   torch.randn(blocks, 16, 8, 128, device="cuda", dtype=BF16))
                  for _ in range(copies_to_defeat_l2(kv_bytes))]
        tables = torch.randperm(blocks, device="cuda").view(batch, -1).int()
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, 32, 128, device="cuda", dtype=BF16)
        results = []
        for splits, block_n, warps, stages in itertools.product(
                (1, 4, 8, 16, 32, 64), (32, 64, 128), (4, 8), (1, 2, 3)):
            if batch * 8 * splits > 8 * 132 * 4 or context // splits < block_n:
                continue
            seconds = time_graphed(lambda i: paged_decode_attention(
                q, *caches[i % len(caches)], tables, seq_lens, 128 ** -0.5, num_splits=splits,
                block_n=block_n, num_warps=warps, num_stages=stages), reps=5)
            results.append((seconds, splits, block_n, warps, stages))
        results.sort()
        for seconds, splits, block_n, warps, stages in results[:3]:
            lines.append(f"attention {batch}x{context}: splits={splits} block_n={block_n} "
                         f"warps={warps} stages={stages}: {seconds * 1e6:.1f} us "
                         f"({kv_bytes / seconds / copy_bps:.0%} of copy BW)")
        del caches
    return lines


def compare_matmul_forms(copy_bps: float) -> list[str]:
    """cuBLAS through F.linear (x W^T) against torch.mv (W x) for one row, cold weights."""
    lines = []
    for name, (n, k) in {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                         "down": (4096, 14336)}.items():
        weights = [torch.randn(n, k, device="cuda", dtype=BF16)
                   for _ in range(copies_to_defeat_l2(n * k * 2))]
        x = torch.randn(1, k, device="cuda", dtype=BF16)
        floor = n * k * 2 / copy_bps
        linear = time_graphed(lambda i: torch.nn.functional.linear(x, weights[i % len(weights)]))
        mv = time_graphed(lambda i: torch.mv(weights[i % len(weights)], x[0]))
        lines.append(f"matmul {name} 1x{k}x{n}: F.linear {linear * 1e6:.1f} us "
                     f"({floor / linear:.0%} of copy BW), torch.mv {mv * 1e6:.1f} us "
                     f"({floor / mv:.0%})")
        del weights
    return lines


# block_n x block_k x warps x stages. On an H100 a sweep of
# (4, 8, 16) x (256, 512, 1024) x (4, 8) x (3,); 256-wide K and 4 warps never won there. An
# H200 moves 1.5x the bytes per second, so it needs more in flight: wider K, more warps and
# deeper pipelines are in the space too. One or two columns a program are for shapes with few
# output columns (a router's 128, Qwen3-30B-A3B's o_proj 2048), where 8 leave SMs idle.
GEMV_SPACE = sorted(set(
    [(*shape, 3) for shape in itertools.product((4, 8, 16), (512, 1024), (4, 8))]
    + list(itertools.product((4, 8, 16), (1024, 2048), (8, 16), (2, 3, 4)))
    + list(itertools.product((1, 2), (512, 1024, 2048), (4, 8), (2, 3)))))


# name -> (N, K, add + RMSNorm first, SiLU * mul, keeps the normed row)
GEMV_SHAPES = {
    "llama3-8b": {name: (*shape, False) for name, shape in PROJECTIONS.items()},
    "qwen3-30b-a3b": {"qkv": (5120, 2048, True, False, False),
                      "o": (2048, 4096, False, False, False),
                      "router": (128, 2048, True, False, True)},
}


def tune_gemv(copy_bps: float, model: str = "llama3-8b") -> list[str]:
    """The one-row fused GEMV at a model's batch-1 shapes (GEMV_SHAPES), cold weights."""
    lines = []
    for name, (n, k, norm, silu, keeps_normed) in GEMV_SHAPES[model].items():
        weights = [torch.randn(n, k, device="cuda", dtype=BF16)
                   for _ in range(copies_to_defeat_l2(n * k * 2))]
        norm_weight = torch.ones(k, device="cuda", dtype=BF16) if norm else None
        x = torch.randn(1, k, device="cuda", dtype=BF16)
        res = torch.randn_like(x) if norm else None
        normed = torch.empty_like(x) if keeps_normed else None
        results = []
        default = default_config(n // 2 if silu else n, k, silu)
        for block_n, block_k, warps, stages in GEMV_SPACE:
            cfg = {"block_n": block_n, "block_k": block_k, "num_warps": warps,
                   "num_stages": stages}
            try:
                seconds = time_graphed(lambda i: fused_gemv(
                    x, weights[i % len(weights)], residual=res, norm_weight=norm_weight,
                    silu_mul=silu, normed_out=normed, config=cfg), reps=5)
            except Exception as exc:  # e.g. out of shared memory: skip the config
                lines.append(f"gemv {name} {cfg}: {type(exc).__name__}")
                continue
            results.append((seconds, cfg == default, cfg))
        results.sort(key=lambda r: r[0])
        floor = n * k * 2 / copy_bps
        default_row = [r for r in results if r[1]]
        for seconds, is_default, cfg in results[:3] + default_row:
            lines.append(f"gemv {name} 1x{k}x{n}: {cfg}{' (default)' if is_default else ''}"
                         f": {seconds * 1e6:.1f} us ({floor / seconds:.0%} of copy BW)")
        del weights
    return lines


def main() -> int:
    args = sys.argv[1:]
    gemv_only = "--gemv" in args
    rest = args[args.index("--gemv") + 1:] if gemv_only else []
    model = rest[0] if rest else "llama3-8b"
    if model not in GEMV_SHAPES:
        print(f"unknown model {model!r}; one of {', '.join(GEMV_SHAPES)}", file=sys.stderr)
        return 2
    limits = measure_limits()
    lines = [f"{limits.name}: copy {limits.copy_bytes_per_s / 1e12:.2f} TB/s"]
    if gemv_only:
        print("\n".join(lines + tune_gemv(limits.copy_bytes_per_s, model)))
        return 0
    lines += tune_attention(limits.copy_bytes_per_s)
    lines += compare_matmul_forms(limits.copy_bytes_per_s)
    lines += tune_gemv(limits.copy_bytes_per_s)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
