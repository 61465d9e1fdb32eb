"""Batch-1 decode on aiter-triton: the projections as fused GEMV kernels.

A dense decoder layer at MAX_ROWS token(s) runs as six launches instead of about thirteen
(workers/ops/gpu/decode_gemv.py says what is fused and why):

    [add + rms_norm + qkv] [rope + KV write + attention splits] [combine] [o_proj]
    [add + rms_norm + gate_up + silu*mul] [down]

(RoPE and the KV write run in the whole-block attention kernel's launch where it takes them,
ops/attention_gpu.py; otherwise in a launch of their own before the attention.)

This module holds only the decision and the calls; it imports no Triton until a kernel runs, so
CPU installs (no triton) can import the models.
"""
from __future__ import annotations

import torch

from tandem.workers.ops.backend import KernelBackend
from tandem.workers.ops.linear import LinearBase, RowParallelLinear
from tandem.workers.ops.norm import RMSNorm
from tandem.workers.parallel.all_reduce import tp_all_reduce

MAX_ROWS = 1  # fused_gemv takes one row; at 2+ rows cuBLAS reads the weights faster


def fusable(norms: tuple[RMSNorm, ...], linears: tuple[LinearBase, ...]) -> bool:
    """The fused path computes exactly these layers' functions: aiter-triton norms and linears
    without bias. Under TP a column-parallel linear's GEMV gives this rank's output shard as
    its forward does, and a row-parallel one's partial sum is all-reduced (`linear`)."""
    return (all(norm.backend is KernelBackend.AITER_TRITON for norm in norms)
            and all(lin.bias is None for lin in linears))


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                linear: LinearBase, *, silu_mul: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(x + residual)), x + residual) as RMSNorm + linear would give them; with
    silu_mul the linear is [gate | up] and the first result is silu(gate) * up. residual None
    (the first layer): norm(x), and x is the residual stream."""
    from tandem.workers.ops.gpu.decode_gemv import fused_gemv
    y, new_residual = fused_gemv(x, linear.weight, residual=residual, norm_weight=norm.weight,
                                 eps=norm.eps, silu_mul=silu_mul)
    return y, (x if residual is None else new_residual)


def norm_router(x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, gate: LinearBase
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate(h), x + residual, h) with h = norm(x + residual) in one launch: a mixture-of-
    experts layer's router logits, residual stream and the experts' input."""
    from tandem.workers.ops.gpu.decode_gemv import fused_gemv
    normed = torch.empty_like(x)
    logits, new_residual = fused_gemv(x, gate.weight, residual=residual,
                                      norm_weight=norm.weight, eps=norm.eps, normed_out=normed)
    return logits, new_residual, normed


def linear(x: torch.Tensor, layer: LinearBase) -> torch.Tensor:
    """layer(x); a row-parallel layer's partial sums are all-reduced over the TP group, as
    RowParallelLinear.forward does."""
    from tandem.workers.ops.gpu.decode_gemv import fused_gemv
    y = fused_gemv(x, layer.weight)[0]
    if isinstance(layer, RowParallelLinear) and layer.tp_size > 1:
        tp_all_reduce(y)
    return y
