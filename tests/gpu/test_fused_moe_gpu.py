"""AITER's Triton fused_moe (backend 'aiter-triton') against the torch backend, on the GPU, bf16.

Skips without a GPU (tests/gpu/conftest.py) or without amd-aiter. Run as a script for a table
of errors and timings:  PYTHONPATH=tests python tests/gpu/test_fused_moe_gpu.py
"""
from __future__ import annotations

import pytest
import torch
from helpers.moe_cases import rel
from helpers.moe_cases import routed_case as make_case

from tandem.workers.ops.aiter_compat import aiter_available
from tandem.workers.ops.moe import torch_fused_moe
from tandem.workers.ops.moe_aiter import aiter_triton_fused_moe

if not aiter_available():
    pytest.skip("amd-aiter is not installed (pip install amd-aiter)", allow_module_level=True)

# (experts, top_k, hidden, intermediate): Mixtral-like small, and Qwen3-30B-A3B's expert shape.
SHAPES = [(8, 2, 1024, 512), (64, 8, 1024, 512), (128, 8, 2048, 768)]
TOKENS = [1, 7, 64, 512, 4096]
MAX_REL = 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("num_experts, top_k, hidden_size, size", SHAPES)
def test_aiter_triton_matches_torch_bf16(num_tokens, num_experts, top_k, hidden_size, size):
    args = make_case(num_tokens, num_experts, top_k, hidden_size, size, seed=num_tokens)
    out = aiter_triton_fused_moe(*args)
    ref = torch_fused_moe(*args)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    assert rel(out, ref) <= MAX_REL


@pytest.mark.gpu
def test_fused_moe_module_runs_on_aiter_backend():
    from tandem.workers.ops.backend import KernelBackend
    from tandem.workers.ops.moe import FusedMoE
    E, k, H, I = 8, 2, 256, 128
    hidden, w13, w2, weights, ids = make_case(33, E, k, H, I)
    layers = [FusedMoE(E, H, I, backend=b).to("cuda", torch.bfloat16)
              for b in (KernelBackend.TORCH, KernelBackend.AITER_TRITON)]
    for layer in layers:
        layer.w13.data.copy_(w13)
        layer.w2.data.copy_(w2)
    out, ref = (layer(hidden, weights, ids) for layer in reversed(layers))
    assert rel(out, ref) <= MAX_REL


def main() -> None:  # pragma: no cover - GPU bench
    from triton.testing import do_bench
    from tandem.workers.ops.moe_aiter import aiter_moe_config

    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'E':>4} {'k':>2} {'H':>5} {'I':>4} {'T':>5} {'BM':>4} "
          f"{'rel(aiter,torch bf16)':>22} {'rel(aiter,fp32)':>16} {'rel(torch bf16,fp32)':>21}")
    for E, k, H, I in SHAPES:
        for T in TOKENS:
            args = make_case(T, E, k, H, I, seed=T)
            out = aiter_triton_fused_moe(*args)
            ref = torch_fused_moe(*args)
            hidden, w13, w2, weights, ids = args
            ref32 = torch_fused_moe(hidden.float(), w13.float(), w2.float(), weights, ids)
            bm = aiter_moe_config(T, k, E)["BLOCK_SIZE_M"]
            print(f"{E:>4} {k:>2} {H:>5} {I:>4} {T:>5} {bm:>4} {rel(out, ref):>22.2e} "
                  f"{rel(out, ref32):>16.2e} {rel(ref, ref32):>21.2e}")
    print("\ntimings, E=128 k=8 H=2048 I=768, bf16 (median of do_bench; expert weights 1.21 GB)")
    print("eager = Python calls one after another (host-bound); graph = the aiter call captured "
          "in a CUDA graph (torch backend syncs, so it has no graph time)")
    E, k, H, I = SHAPES[-1]
    configs = {
        "default": None,
        "BM16 BN64 BK128 w4 s4": dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128,
                                      GROUP_SIZE_M=1, num_warps=4, num_stages=4),
        "BM16 BN128 BK128 w4 s3": dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128,
                                       GROUP_SIZE_M=1, num_warps=4, num_stages=3),
        "BM32 BN128 BK64 w4 s4": dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64,
                                      GROUP_SIZE_M=8, num_warps=4, num_stages=4),
        "BM64 BN128 BK64 w8 s3": dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64,
                                      GROUP_SIZE_M=8, num_warps=8, num_stages=3),
        "BM128 BN128 BK64 w8 s3": dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64,
                                       GROUP_SIZE_M=8, num_warps=8, num_stages=3),
    }
    for T in (1, 512, 4096):
        args = make_case(T, E, k, H, I, seed=1)
        touched = int(args[4].unique().numel())
        floor_us = touched / E * 1.208e9 / 3.35e12 * 1e6  # expert weights read once, H100 HBM
        line = f"T={T:>4}: experts touched {touched}, weight-read floor ~{floor_us:.0f} us"
        if T <= 512:
            line += f"; torch eager {do_bench(lambda: torch_fused_moe(*args), return_mode='median') * 1e3:.1f} us"
        print(line)
        for name, cfg in configs.items():
            fn = lambda: aiter_triton_fused_moe(*args, config=cfg)  # noqa: E731
            eager = do_bench(fn, return_mode="median")
            fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fn()
            graph.replay()
            torch.cuda.synchronize()
            err = rel(out, torch_fused_moe(*args))
            timed = do_bench(graph.replay, return_mode="median")
            label = name if cfg else f"default (BM{aiter_moe_config(T, k, E)['BLOCK_SIZE_M']})"
            print(f"    aiter {label:<24} eager {eager * 1e3:8.1f} us   graph {timed * 1e3:8.1f} us"
                  f"   rel {err:.1e}")


if __name__ == "__main__":
    main()
