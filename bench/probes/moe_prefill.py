"""One MoE layer's prefill on this GPU: the AITER path against our grouped GEMMs, per part.

    python bench/probes/moe_prefill.py --out moe_prefill.json     # Qwen3-30B-A3B's experts
    python bench/probes/moe_prefill.py --tokens 8192 --experts 256 --hidden 7168 \\
        --intermediate 2048 --out ds.json

For each token count: the current path (torch align_by_expert, AITER fused_moe gate_up, torch
silu*mul, AITER fused_moe down, torch sum over k; skipped without amd-aiter) and the new one
(workers/ops/gpu/moe_prefill.py: Triton align, gate_up with SiLU-and-mul fused, down, sum over
k), each part and the whole call timed (CUDA events, median), in ms and as a fraction of the
bf16 matmul rate measured in the same run (expert FLOPs only: 2 * T * k * 3 * H * I for a
whole layer). Then a sweep of gate_up tiles (and, at the largest token count, a few down
tiles), the best printed. Random routing (softmax top-k of random logits), random weights.
The new path's output is checked against torch's first.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch
import torch.nn.functional as F

from tandem.bench.engine_limits import measure_limits, time_cuda
from tandem.workers.ops.gpu import moe_prefill
from tandem.workers.ops.gpu.moe_prefill import GemmConfig, PrefillConfig
from tandem.workers.ops.moe import select_experts, torch_fused_moe
from tandem.workers.ops.moe_aiter import aiter_moe_config, aiter_triton_fused_moe, align_by_expert

BF16 = torch.bfloat16
REPS = 10

# gate_up tiles swept (block_m, block_n, num_warps, num_stages, group_size_m; block_k 64;
# block_n columns of I, so a program computes block_n gate and block_n up columns): 24 of the
# 32 combinations, leaving out 4 warps on 128 x 128 (a 128 x 256 fp32 accumulator on 128
# threads) and 8 warps on 64 x 64.
GATE_UP_SWEEP = [(m, n, w, s, g) for m, n, w, s, g in itertools.product(
                     (64, 128), (64, 128), (4, 8), (3, 4), (4, 8))
                 if (m, n, w) not in ((128, 128, 4), (64, 64, 8))]
DOWN_SWEEP = [GemmConfig(256, 64, 8, 4, g) for g in (1, 4, 8, 16)] + [
    GemmConfig(256, 64, 8, 3), GemmConfig(128, 64, 8, 4), GemmConfig(128, 64, 4, 4),
    GemmConfig(128, 128, 8, 3)]


def case(args, num_tokens: int):
    e, k, h, i = args.experts, args.top_k, args.hidden, args.intermediate
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=BF16, generator=gen) * h ** -0.5
    w2 = torch.randn(e, h, i, device="cuda", dtype=BF16, generator=gen) * i ** -0.5
    hidden = torch.randn(num_tokens, h, device="cuda", dtype=BF16, generator=gen)
    logits = torch.randn(num_tokens, e, device="cuda", generator=gen)
    weights, ids = select_experts(logits, k, renormalize=True)
    return hidden, w13, w2, weights, ids


def rel_error_against_torch(c) -> float:
    """|new - torch| / |torch| over the first 256 tokens (the torch layer loops over experts)."""
    hidden, w13, w2, weights, ids = c
    rows = slice(0, 256)
    ref = torch_fused_moe(hidden[rows], w13, w2, weights[rows], ids[rows]).float()
    out = moe_prefill.prefill_fused_moe(hidden, w13, w2, weights, ids)[rows].float()
    return ((out - ref).norm() / ref.norm()).item()


def timed_parts(parts: dict, flops: dict, matmul_rate: float) -> dict:
    """Each part's median ms and fraction of the matmul rate, and their total."""
    out = {}
    for name, fn in parts.items():
        seconds = time_cuda(fn, reps=REPS)
        out[name] = {"ms": seconds * 1e3,
                     "of_matmul_rate": flops.get(name, 0) / seconds / matmul_rate}
    total_s = sum(p["ms"] for p in out.values()) / 1e3
    out["total of parts"] = {"ms": total_s * 1e3,
                             "of_matmul_rate": flops["layer"] / total_s / matmul_rate}
    return out


def current_path(args, c, flops, matmul_rate) -> dict | None:
    from tandem.workers.ops.aiter_compat import aiter_available, load_aiter_triton
    if not aiter_available():
        return None
    aiter = load_aiter_triton()
    hidden, w13, w2, weights, ids = c
    t, k, i, h = hidden.shape[0], args.top_k, args.intermediate, args.hidden
    cfg = aiter_moe_config(t, k, args.experts)
    sorted_ids, expert_ids, num_post_pad = align_by_expert(ids, args.experts, cfg["BLOCK_SIZE_M"])
    gate_up = torch.empty(t, k, 2 * i, dtype=BF16, device="cuda")
    act = torch.empty(t * k, i, dtype=BF16, device="cuda")
    down = torch.empty(t, k, h, dtype=BF16, device="cuda")
    w32, i32 = weights.float().contiguous(), ids.contiguous()

    def fused_moe(a, w, out, mul_weight, top_k):
        aiter.fused_moe(a, w, out, None, None, None, w32, i32, sorted_ids, expert_ids,
                        num_post_pad, mul_weight, top_k, aiter.tl.bfloat16, False, False,
                        False, None, cfg)
    parts = {
        "align": lambda: align_by_expert(ids, args.experts, cfg["BLOCK_SIZE_M"]),
        "gate_up": lambda: fused_moe(hidden, w13, gate_up, False, k),
        "silu*mul": lambda: torch.mul(F.silu(gate_up[..., :i]), gate_up[..., i:],
                                      out=act.view(t, k, i)),
        "down": lambda: fused_moe(act, w2, down, True, 1),
        "sum over k": lambda: down.sum(dim=1),
    }
    result = timed_parts(parts, flops, matmul_rate)
    seconds = time_cuda(lambda: aiter_triton_fused_moe(*c), reps=REPS)
    result["whole call"] = {"ms": seconds * 1e3,
                            "of_matmul_rate": flops["layer"] / seconds / matmul_rate}
    result["config"] = cfg
    return result


def new_path(args, c, flops, matmul_rate, config: PrefillConfig) -> dict:
    hidden, w13, w2, weights, ids = c
    t, k, h = hidden.shape[0], args.top_k, args.hidden
    aligned = moe_prefill.align_by_expert(ids, args.experts, config.block_m)
    act = moe_prefill.gate_up_silu(hidden, w13, *aligned, k, config.block_m, config.gate_up)
    pair_out = moe_prefill.down_weighted(act, w2, weights, *aligned, config.block_m,
                                         config.down)
    parts = {
        "align": lambda: moe_prefill.align_by_expert(ids, args.experts, config.block_m),
        "gate_up": lambda: moe_prefill.gate_up_silu(hidden, w13, *aligned, k, config.block_m,
                                                    config.gate_up),
        "down": lambda: moe_prefill.down_weighted(act, w2, weights, *aligned, config.block_m,
                                                  config.down),
        "sum over k": lambda: pair_out.view(t, k, h).sum(dim=1),
    }
    result = timed_parts(parts, flops, matmul_rate)
    seconds = time_cuda(lambda: moe_prefill.prefill_fused_moe(hidden, w13, w2, weights, ids,
                                                              config=config), reps=REPS)
    result["whole call"] = {"ms": seconds * 1e3,
                            "of_matmul_rate": flops["layer"] / seconds / matmul_rate}
    result["config"] = repr(config)
    return result


def sweep(args, c, flops, matmul_rate, default: PrefillConfig, with_down: bool) -> dict:
    hidden, w13, w2, weights, ids = c
    k = args.top_k
    rows = []
    for block_m, block_n, warps, stages, group in GATE_UP_SWEEP:
        tile = GemmConfig(block_n, 64, warps, stages, group)
        aligned = moe_prefill.align_by_expert(ids, args.experts, block_m)
        try:
            seconds = time_cuda(lambda: moe_prefill.gate_up_silu(
                hidden, w13, *aligned, k, block_m, tile), reps=REPS)
        except Exception as exc:  # a tile that does not fit fails to compile: say so, go on
            rows.append({"block_m": block_m, "tile": repr(tile), "error": type(exc).__name__})
            continue
        rows.append({"block_m": block_m, "tile": repr(tile), "ms": seconds * 1e3,
                     "of_matmul_rate": flops["gate_up"] / seconds / matmul_rate})
    aligned = moe_prefill.align_by_expert(ids, args.experts, default.block_m)
    act = moe_prefill.gate_up_silu(hidden, w13, *aligned, k, default.block_m, default.gate_up)
    down_rows = []
    for tile in DOWN_SWEEP if with_down else ():
        try:
            seconds = time_cuda(lambda: moe_prefill.down_weighted(
                act, w2, weights, *aligned, default.block_m, tile), reps=REPS)
        except Exception as exc:
            down_rows.append({"block_m": default.block_m, "tile": repr(tile),
                              "error": type(exc).__name__})
            continue
        down_rows.append({"block_m": default.block_m, "tile": repr(tile), "ms": seconds * 1e3,
                          "of_matmul_rate": flops["down"] / seconds / matmul_rate})
    return {"gate_up": rows, "down": down_rows}


def fmt_parts(title: str, result: dict) -> list[str]:
    lines = [f"  {title}  ({result['config']})"]
    for name, part in result.items():
        if name != "config":
            lines.append(f"    {name:>14}: {part['ms']:7.3f} ms  {part['of_matmul_rate']:6.1%}")
    return lines


def best_of(rows: list[dict]) -> dict | None:
    timed = [r for r in rows if "ms" in r]
    return min(timed, key=lambda r: r["ms"]) if timed else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=lambda s: [int(t) for t in s.split(",")],
                        default=[2048, 8192])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--no-sweep", action="store_true", help="default configs only")
    parser.add_argument("--out", required=True, help="JSON file for the full results")
    args = parser.parse_args()
    started = time.monotonic()
    limits = measure_limits()
    matmul_rate = limits.matmul_flops_per_s
    results = {"limits": limits.as_dict(), "shape": vars(args), "runs": []}
    print(limits.as_dict(), flush=True)
    for num_tokens in args.tokens:
        c = case(args, num_tokens)
        pair_flops = 2 * num_tokens * args.top_k * args.hidden * args.intermediate
        flops = {"gate_up": 2 * pair_flops, "down": pair_flops, "layer": 3 * pair_flops}
        default = moe_prefill.default_config(num_tokens, args.top_k, args.experts)
        run = {"tokens": num_tokens, "layer_GFLOP": flops["layer"] / 1e9,
               "new_vs_torch_rel_error": rel_error_against_torch(c),
               "current": current_path(args, c, flops, matmul_rate),
               "new": new_path(args, c, flops, matmul_rate, default)}
        lines = [f"{num_tokens} tokens: layer {flops['layer'] / 1e9:.0f} GFLOP, matmul rate "
                 f"{matmul_rate / 1e12:.0f} TFLOP/s; new path against torch: relative error "
                 f"{run['new_vs_torch_rel_error']:.1e}"]
        lines += fmt_parts("current", run["current"]) if run["current"] else [
            "  current: skipped (amd-aiter is not installed)"]
        lines += fmt_parts("new", run["new"])
        if run["current"]:
            before, after = run["current"]["whole call"], run["new"]["whole call"]
            lines.append(f"  whole call: current {before['ms']:.3f} ms "
                         f"({before['of_matmul_rate']:.1%}), new {after['ms']:.3f} ms "
                         f"({after['of_matmul_rate']:.1%}), {before['ms'] / after['ms']:.2f}x")
        if not args.no_sweep:
            # down tiles at the largest token count only: each block_m compiles them anew
            run["sweep"] = sweep(args, c, flops, matmul_rate, default,
                                 with_down=num_tokens == max(args.tokens))
            for name in ("gate_up", "down"):
                best = best_of(run["sweep"][name])
                run[f"best_{name}"] = best
                if best:
                    lines.append(f"  best {name:>7}: {best['ms']:7.3f} ms  "
                                 f"{best['of_matmul_rate']:6.1%}  block_m={best['block_m']} "
                                 f"{best['tile']}")
        results["runs"].append(run)
        print("\n".join(lines), flush=True)
        del c
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"full results: {args.out} ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
