"""One MoE layer's experts on this GPU: the decode kernels against AITER's fused_moe, per batch.

    python bench/probes/moe_layer.py                    # Qwen3-30B-A3B's experts, ~2 min
    python bench/probes/moe_layer.py --experts 256 --top-k 8 --hidden 7168 --intermediate 2048

Decode (`--batches`): routing from random logits, then the experts, timed as CUDA-graph replays
with the weights rotated through copies so they come from HBM (bench/engine_limits). Three
paths: `aiter` (select_experts + moe_aiter.aiter_triton_fused_moe, the general path), `decode`
(moe_decode.decode_moe with the logits: route, align and both projections in its own kernels)
at its default config, and the best of a small sweep of decode configs. The floor is the
distinct chosen experts' bytes at the measured copy bandwidth.

Prefill (`--prefill-tokens`): AITER's fused_moe at a handful of block configs, as a fraction of
the measured bf16 matmul rate (expert FLOPs only). bench/probes/moe_prefill.py splits the
default config's time into align, gate_up, silu*mul, down and the sum over k, beside our
prefill kernels.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch

from tandem.bench.engine_limits import copies_to_defeat_l2, measure_limits, time_cuda, time_graphed
from tandem.workers.ops.gpu import moe_decode
from tandem.workers.ops.moe import select_experts
from tandem.workers.ops.moe_aiter import aiter_moe_config, aiter_triton_fused_moe

BF16 = torch.bfloat16


def expert_weights(args, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    e, h, i = args.experts, args.hidden, args.intermediate
    return [(torch.randn(e, 2 * i, h, device="cuda", dtype=BF16) * h ** -0.5,
             torch.randn(e, h, i, device="cuda", dtype=BF16) * i ** -0.5)
            for _ in range(copies)]


def decode_table(args, copy_bps: float) -> list[str]:
    e, k, h, i = args.experts, args.top_k, args.hidden, args.intermediate
    expert_bytes = 3 * h * i * 2
    weights = expert_weights(args, copies_to_defeat_l2(e * expert_bytes))
    configs = [dict(block_m=16, gate_up_block_n=n, down_block_n=dn, block_k=bk, down_block_k=dk,
                    num_warps=w, num_stages=s)
               for n, dn, bk, dk, (w, s) in itertools.product(
                   (16, 32, 64), (16, 64), (128, 256), (128, 256), ((4, 3), (4, 4), (8, 3)))]
    lines = [f"{'batch':>5} {'floor us':>8} {'aiter us':>8} {'decode us':>9} {'best us':>8} "
             f"{'best/floor':>10}  best config"]
    for batch in args.batches:
        gen = torch.Generator(device="cuda").manual_seed(batch)
        hidden = torch.randn(batch, h, device="cuda", dtype=BF16, generator=gen)
        logits = torch.randn(batch, e, device="cuda", generator=gen).to(BF16)
        _, ids = select_experts(logits, k, renormalize=True)
        floor = ids.unique().numel() * expert_bytes / copy_bps

        def aiter(j):
            w, t = select_experts(logits, k, renormalize=True)
            return aiter_triton_fused_moe(hidden, *weights[j % len(weights)], w, t)

        def decode(j, config=None):
            return moe_decode.decode_moe(hidden, *weights[j % len(weights)],
                                         router_logits=logits, top_k=k, config=config)
        aiter_s = time_graphed(aiter)
        decode_s = time_graphed(decode) if moe_decode.fits(batch, k) else float("nan")
        best = (float("inf"), None)
        if moe_decode.fits(batch, k):
            for config in configs:
                best = min(best, (time_graphed(lambda j: decode(j, config)), str(config)),
                           key=lambda r: r[0])
        lines.append(f"{batch:>5} {floor * 1e6:8.1f} {aiter_s * 1e6:8.1f} {decode_s * 1e6:9.1f} "
                     f"{best[0] * 1e6:8.1f} {best[0] / floor:10.2f}  {best[1]}")
    del weights
    torch.cuda.empty_cache()
    return lines


def prefill_table(args, matmul_flops: float) -> list[str]:
    e, k, h, i = args.experts, args.top_k, args.hidden, args.intermediate
    tokens = args.prefill_tokens
    w13, w2 = expert_weights(args, 1)[0]
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(tokens, h, device="cuda", dtype=BF16, generator=gen)
    weights, ids = select_experts(torch.randn(tokens, e, device="cuda", generator=gen), k,
                                  renormalize=True)
    flops = 2 * tokens * k * 3 * h * i
    lines = [f"prefill {tokens} tokens, expert FLOPs {flops / 1e9:.0f} G, matmul rate "
             f"{matmul_flops / 1e12:.0f} TFLOP/s"]
    default = aiter_moe_config(tokens, k, e)
    configs = [default] + [dict(BLOCK_SIZE_M=m, BLOCK_SIZE_N=n, BLOCK_SIZE_K=bk,
                                GROUP_SIZE_M=g, num_warps=w, num_stages=s)
                           for m, n, bk, g, w, s in ((128, 128, 64, 8, 8, 4),
                                                     (128, 256, 64, 8, 8, 3),
                                                     (64, 128, 64, 8, 4, 4),
                                                     (128, 128, 128, 8, 8, 3),
                                                     (64, 256, 64, 8, 8, 3),
                                                     (128, 64, 64, 8, 4, 4),
                                                     (256, 128, 64, 8, 8, 3))]
    for config in configs:
        try:
            seconds = time_cuda(lambda: aiter_triton_fused_moe(hidden, w13, w2, weights, ids,
                                                               config=config), reps=5)
        except Exception as exc:  # an over-sized config fails to compile: say so, go on
            lines.append(f"  {config}: failed ({type(exc).__name__})")
            continue
        lines.append(f"  {seconds * 1e3:7.2f} ms  {flops / seconds / matmul_flops:5.1%}  "
                     f"{config}{'  (default)' if config is default else ''}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")],
                        default=[1, 4, 8, 16, 64, 128])
    parser.add_argument("--prefill-tokens", type=int, default=8192, help="0: skip")
    args = parser.parse_args()
    limits = measure_limits()
    print(limits.as_dict())
    lines = decode_table(args, limits.copy_bytes_per_s)
    if args.prefill_tokens:
        lines += prefill_table(args, limits.matmul_flops_per_s)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
