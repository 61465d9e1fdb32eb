"""Sweep the launch settings of our decode-path kernels on this GPU and print the best per shape.

    python -m tandem.bench.tune_kernels            # about a minute on an H100

Decode attention (split-KV): splits x tile x warps x stages at Llama-8B's heads (32 q / 8 kv,
head 128, block 16); skinny GEMM: split-K x tile at Llama-8B's four projections for 1 and 8
rows, against F.linear (cuBLAS). Times are CUDA-graph replays (bench/engine_limits.time_graphed).
The chosen defaults in workers/ops/gpu/ come from this table; rerun it on a new GPU.
"""
from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F

from tandem.bench.engine_limits import measure_limits, time_graphed
from tandem.workers.ops.gpu.paged_decode import paged_decode_attention
from tandem.workers.ops.gpu.skinny_gemm import skinny_linear

BF16 = torch.bfloat16


def tune_attention(copy_bps: float) -> list[str]:
    lines = []
    for batch, context in ((1, 1024), (1, 4096), (8, 4096), (64, 4096)):
        blocks = batch * context // 16
        k_cache = torch.randn(blocks, 16, 8, 128, device="cuda", dtype=BF16)
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(blocks, device="cuda").view(batch, -1).int()
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, 32, 128, device="cuda", dtype=BF16)
        kv_bytes = 2 * batch * context * 8 * 128 * 2
        results = []
        for splits, block_n, warps, stages in itertools.product(
                (1, 4, 8, 16, 32, 64), (16, 32, 64, 128), (2, 4, 8), (1, 2, 3)):
            if batch * 8 * splits > 8 * 132 * 4 or context // splits < block_n:
                continue
            seconds = time_graphed(lambda: paged_decode_attention(
                q, k_cache, v_cache, tables, seq_lens, 128 ** -0.5, num_splits=splits,
                block_n=block_n, num_warps=warps, num_stages=stages), reps=5)
            results.append((seconds, splits, block_n, warps, stages))
        results.sort()
        for seconds, splits, block_n, warps, stages in results[:3]:
            lines.append(f"attention {batch}x{context}: splits={splits} block_n={block_n} "
                         f"warps={warps} stages={stages}: {seconds * 1e6:.1f} us "
                         f"({kv_bytes / seconds / copy_bps:.0%} of copy BW)")
        del k_cache, v_cache
    return lines


def tune_gemm(copy_bps: float) -> list[str]:
    lines = []
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
              "down": (4096, 14336)}
    for (name, (n, k)), rows in itertools.product(shapes.items(), (1, 8)):
        weight = torch.randn(n, k, device="cuda", dtype=BF16)
        x = torch.randn(rows, k, device="cuda", dtype=BF16)
        floor = n * k * 2 / copy_bps
        cublas = time_graphed(lambda: F.linear(x, weight), reps=5)
        results = []
        for split_k, block_n, block_k, warps, stages in itertools.product(
                (1, 2, 4, 8), (32, 64, 128), (64, 128, 256), (4, 8), (3, 4)):
            seconds = time_graphed(lambda: skinny_linear(
                x, weight, split_k=split_k, block_n=block_n, block_k=block_k,
                num_warps=warps, num_stages=stages), reps=5)
            results.append((seconds, split_k, block_n, block_k, warps, stages))
        best = min(results)
        lines.append(f"gemm {name} {rows}x{k}x{n}: cuBLAS {cublas * 1e6:.1f} us "
                     f"({floor / cublas:.0%} of copy BW); skinny best {best[0] * 1e6:.1f} us "
                     f"({floor / best[0]:.0%}) split_k={best[1]} block_n={best[2]} "
                     f"block_k={best[3]} warps={best[4]} stages={best[5]}")
        del weight
    return lines


def main() -> int:
    limits = measure_limits()
    lines = [f"{limits.name}: copy {limits.copy_bytes_per_s / 1e12:.2f} TB/s"]
    lines += tune_attention(limits.copy_bytes_per_s)
    lines += tune_gemm(limits.copy_bytes_per_s)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
