"""Fresh-prefill attention under GQA: which way of handing SDPA fewer K/V heads is fastest.

    python bench/probes/prefill_attention.py [--tokens 8192] [--heads 32] [--kv-heads 4]

One causal prompt at a model's heads (default Qwen3-30B-A3B's: 32 query / 4 KV heads, head
128, bf16), laid out as the engine holds it ([T, H, D] token-major). Each form is timed with
CUDA events (median of 10), with its peak extra memory, and compared with the first form's
output:

    repeat_interleave   K/V heads repeated by index_select, then SDPA (the old path)
    expand copy         K/V heads repeated by one strided copy (attention_gpu._heads_repeated)
    enable_gqa          SDPA on the unrepeated K/V with enable_gqa=True, default dispatch
    enable_gqa cudnn    the same, the cuDNN backend forced
    enable_gqa flash    the same, the flash backend forced
    qkv views           enable_gqa on q, k and v viewed out of one fused qkv row per token, as
                        the engine's qkv projection leaves them (token stride (H + 2 KVH) D)
    repeated cudnn      the expand copy with the cuDNN backend forced
    repeated flash      the expand copy with the flash backend forced

A form the backend refuses prints its error and is skipped. TFLOP/s counts the causal half of
the 4 * T^2 * H * D attention FLOPs; the last column is that against the bf16 matmul rate
measured in the same run.
"""
from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tandem.bench.engine_limits import measure_limits, time_cuda
from tandem.workers.ops.attention_gpu import _heads_repeated


def forms(q, k, v, group: int) -> dict:
    """name -> a function of no arguments giving [1, H, T, D]."""
    qs = q.transpose(0, 1).unsqueeze(0)
    kv = [x.transpose(0, 1).unsqueeze(0) for x in (k, v)]
    qkv = torch.cat([x.flatten(1) for x in (q, k, v)], dim=1)  # [T, (H + 2 KVH) D]
    views = [part.view(q.shape[0], -1, q.shape[2]).transpose(0, 1).unsqueeze(0)
             for part in qkv.split([q[0].numel(), k[0].numel(), v[0].numel()], dim=1)]

    def sdpa(keys, values, backend=None, gqa=False):
        ctx = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
        with ctx:
            return F.scaled_dot_product_attention(qs, keys, values, is_causal=True,
                                                  enable_gqa=gqa)

    def interleaved():
        return sdpa(*(x.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
                      for x in (k, v)))

    def expanded(backend=None):
        return sdpa(*(_heads_repeated(x, group) for x in (k, v)), backend)

    return {
        "repeat_interleave": interleaved,
        "expand copy": expanded,
        "enable_gqa": lambda: sdpa(*kv, gqa=True),
        "enable_gqa cudnn": lambda: sdpa(*kv, SDPBackend.CUDNN_ATTENTION, gqa=True),
        "enable_gqa flash": lambda: sdpa(*kv, SDPBackend.FLASH_ATTENTION, gqa=True),
        "qkv views": lambda: F.scaled_dot_product_attention(*views, is_causal=True,
                                                            enable_gqa=True),
        "repeated cudnn": lambda: expanded(SDPBackend.CUDNN_ATTENTION),
        "repeated flash": lambda: expanded(SDPBackend.FLASH_ATTENTION),
    }


def main() -> int:
    p = argparse.ArgumentParser(prog="python bench/probes/prefill_attention.py")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args()
    limits = measure_limits()
    t, h, kvh, d = args.tokens, args.heads, args.kv_heads, args.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(t, kvh, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    flops = 4 * t * t * h * d / 2
    print(f"{limits.name}: matmul {limits.matmul_flops_per_s / 1e12:.0f} TFLOP/s; "
          f"{t} tokens, {h} q / {kvh} kv heads, head {d}")
    print(f"{'form':>20} {'ms':>8} {'TFLOP/s':>8} {'x matmul':>8} {'extra MiB':>9}  same as first")
    reference = None
    for name, fn in forms(q, k, v, h // kvh).items():
        try:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = fn()
            extra = (torch.cuda.max_memory_allocated() - base) / 2**20
            seconds = time_cuda(fn, reps=10)
        except RuntimeError as exc:
            print(f"{name:>20}  refused: {str(exc).splitlines()[0][:100]}")
            continue
        if reference is None:
            reference = out
        diff = (out.float() - reference.float()).abs().max().item()
        print(f"{name:>20} {seconds * 1e3:8.3f} {flops / seconds / 1e12:8.0f} "
              f"{flops / seconds / limits.matmul_flops_per_s:8.0%} {extra:9.0f}  "
              f"max |diff| {diff:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
