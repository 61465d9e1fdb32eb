"""The one-launch cluster decode kernel (workers/ops/gpu/cuda/decode_cluster.cu) against the
Triton split-KV kernel the engine runs (paged_decode.py), decode attention alone.

    python -m tandem.bench.cluster_decode [--shapes 1x4096,1x128,...]

Rows are CUDA-graph replays (engine_limits.time_graphed) at Llama-8B's heads (32 q / 8 kv, head
128, block 16) with the KV rotated through copies so it comes from HBM, as bench/engine.py
times decode attention. For each batch x context: the Triton kernel with the engine's split
count, then the cluster kernel at every split count (= cluster size) that fits one wave and
every built (warps, stages) shape, with its error against the Triton output. Also the
occupancy API's resident-cluster limits. Fractions: KV bytes / time / copy bandwidth.
"""
from __future__ import annotations

import argparse

import torch

from tandem.bench.engine_limits import measure_limits, time_graphed
from tandem.bench.engine_ops import decode_attention_inputs
from tandem.workers.ops.gpu.cluster_decode import (
    SHAPES, cluster_decode_attention, cluster_decode_supported, max_active_clusters)
from tandem.workers.ops.gpu.paged_decode import paged_decode_attention

BF16 = torch.bfloat16
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def shape_rows(batch: int, context: int, copy_bps: float) -> list[tuple[str, str, float, float]]:
    inputs = decode_attention_inputs(batch, context, HEADS, KV_HEADS, HEAD_DIM, BLOCK)
    q, caches, tables, lens = inputs.q, inputs.caches, inputs.tables, inputs.seq_lens
    kv_bytes, splits = inputs.kv_bytes, inputs.splits
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    scale = HEAD_DIM ** -0.5
    name = f"{batch}x{context}"

    def row(what: str, fn) -> tuple[str, str, float, float]:
        seconds = time_graphed(fn)
        return name, what, seconds, kv_bytes / seconds / copy_bps

    ref = paged_decode_attention(q, *caches[0], tables, lens, scale, num_splits=splits)
    rows = [row(f"triton, {splits} splits + combine", lambda i: paged_decode_attention(
        q, *caches[i % len(caches)], tables, lens, scale, num_splits=splits))]
    for n_splits in (1, 2, 4, 8, 16):
        ctas = batch * KV_HEADS * n_splits
        if n_splits > 1 and (ctas > 2 * sms or ctas < sms // 4):
            continue  # more than two waves, or too few CTAs to be worth timing
        for shape in SHAPES:
            out = cluster_decode_attention(q, *caches[0], tables, lens, scale,
                                           num_splits=n_splits, shape=shape)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            rows.append(row(
                f"cluster, {n_splits} splits, {shape[0]} warps x {shape[1]} stages "
                f"(err {err:.0e})",
                lambda i, n=n_splits, s=shape: cluster_decode_attention(
                    q, *caches[i % len(caches)], tables, lens, scale, num_splits=n, shape=s)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x4096,1x128,1x1024,8x4096,64x4096,1x16384",
                        help="batch x context pairs")
    args = parser.parse_args(argv)
    probe = torch.empty(1, HEADS, HEAD_DIM, dtype=BF16, device="cuda")
    why_not = cluster_decode_supported(
        probe, torch.empty(1, BLOCK, KV_HEADS, HEAD_DIM, dtype=BF16, device="cuda"), 16)
    if why_not is not None:
        raise SystemExit(f"cluster decode kernel unavailable: {why_not}")
    limits = measure_limits()
    print(f"# {limits.name}, copy {limits.copy_bytes_per_s / 1e12:.2f} TB/s")
    for shape in SHAPES:
        resident = {n: max_active_clusters(BF16, HEADS // KV_HEADS, n, shape=shape)
                    for n in (4, 8, 16)}
        print(f"# resident clusters, {shape[0]} warps x {shape[1]} stages: "
              + ", ".join(f"{n} CTAs: {k}" for n, k in resident.items()))
    rows = []
    for pair in args.shapes.split(","):
        batch, context = map(int, pair.split("x"))
        rows += shape_rows(batch, context, limits.copy_bytes_per_s)
        torch.cuda.empty_cache()
    print(f"{'shape':10s} {'kernel':52s} {'us':>8s} {'of copy':>8s}")
    for name, what, seconds, fraction in rows:
        print(f"{name:10s} {what:52s} {seconds * 1e6:8.2f} {fraction * 100:7.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
