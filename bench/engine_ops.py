"""Per-op timings behind the aiter-triton backend's choices, at an 8B Llama's decode shapes.

Each op is timed inside a CUDA graph (bench/engine_limits.time_graphed), as decode steps run.
Rows name the candidates; `chosen` marks what the backend runs. Decode attention is also
reported as a fraction of copy bandwidth (KV bytes read / time), the issue's target.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from tandem.bench.engine_limits import DeviceLimits, copies_to_defeat_l2, time_graphed
from tandem.workers.ops.activation import SiluAndMul
from tandem.workers.ops.aiter_compat import load_aiter_triton
from tandem.workers.ops.backend import KernelBackend
from tandem.workers.ops.gpu.decode_gemv import fused_gemv
from tandem.workers.ops.attention_gpu import decode_attention, use_block_decode
from tandem.workers.ops.gpu.block_decode import block_decode_supported
from tandem.workers.ops.gpu.paged_decode import num_splits_for
from tandem.workers.ops.norm import RMSNorm
from tandem.workers.ops.rotary import RotaryEmbedding

TORCH, AITER = KernelBackend.TORCH, KernelBackend.AITER_TRITON
BF16 = torch.bfloat16


def _row(op: str, shape: str, impl: str, seconds: float, chosen: bool, **extra) -> dict:
    return {"op": op, "shape": shape, "impl": impl, "us": seconds * 1e6, "chosen": chosen,
            **extra}


def norm_rows(rows: int, hidden: int = 4096) -> list[dict]:
    x = torch.randn(rows, hidden, device="cuda", dtype=BF16)
    res = torch.randn_like(x)
    ref, ours = RMSNorm(hidden, 1e-5, TORCH).cuda().to(BF16), RMSNorm(hidden, 1e-5, AITER).cuda()
    ours.to(BF16)
    weight = ref.weight
    out = [_row("add+rms_norm", f"{rows}x{hidden}", "torch reference ops",
                time_graphed(lambda _: ref(x, res)), False),
           _row("add+rms_norm", f"{rows}x{hidden}", "torch F.rms_norm + add",
                time_graphed(lambda _: F.rms_norm(x + res, (hidden,), weight, 1e-5)), False),
           _row("add+rms_norm", f"{rows}x{hidden}", "ours (Triton, fused)",
                time_graphed(lambda _: ours(x, res)), True)]
    try:
        load_aiter_triton()
        aiter_norm = importlib.import_module("aiter.ops.triton.rmsnorm")
        y, res_out = torch.empty_like(x), torch.empty_like(x)
        out.append(_row("add+rms_norm", f"{rows}x{hidden}", "AITER rmsnorm2d_fwd_with_add",
                        time_graphed(lambda _: aiter_norm.rmsnorm2d_fwd_with_add(
                            y, x, res, res_out, weight, 1e-5)), False))
    except Exception as exc:  # an AITER op that does not run here is reported, not fatal
        out.append(_row("add+rms_norm", f"{rows}x{hidden}", f"AITER: {exc!r:.60}", 0.0, False))
    return out


def activation_rope_rows(rows: int) -> list[dict]:
    gate_up = torch.randn(rows, 2 * 14336, device="cuda", dtype=BF16)
    out = [_row("silu_and_mul", f"{rows}x2x14336", "torch", time_graphed(
               lambda _: SiluAndMul(TORCH)(gate_up)), False),
           _row("silu_and_mul", f"{rows}x2x14336", "ours (Triton)", time_graphed(
               lambda _: SiluAndMul(AITER)(gate_up)), True)]
    params = {"rope_type": "default", "rope_theta": 500000.0}
    ref = RotaryEmbedding(128, 8192, params).cuda()
    ours = RotaryEmbedding(128, 8192, params, backend=AITER).cuda()
    qkv = torch.randn(rows, 48 * 128, device="cuda", dtype=BF16)
    q, k = qkv[:, :4096].view(rows, 32, 128), qkv[:, 4096:5120].view(rows, 8, 128)
    positions = torch.randint(0, 8192, (rows,), device="cuda")
    out += [_row("rope q+k", f"{rows}x(32+8)x128", "torch", time_graphed(
                lambda _: ref(positions, q, k)), False),
            _row("rope q+k", f"{rows}x(32+8)x128", "ours (Triton, in place)", time_graphed(
                lambda _: ours(positions, q, k)), True)]
    return out


@dataclass(frozen=True)
class DecodeAttentionInputs:
    """One decode step's attention inputs at `batch` x `context`, in shuffled blocks."""
    q: torch.Tensor             # [batch, heads, head_dim]
    caches: list[tuple]         # (k_cache, v_cache) copies: rotate through them by call index
    tables: torch.Tensor        # [batch, blocks per sequence] int32
    seq_lens: torch.Tensor      # [batch] int32, all `context`
    kv_bytes: int               # K and V bytes one call reads
    splits: int                 # the engine's split count (num_splits_for)


def decode_attention_inputs(batch: int, context: int, heads: int = 32, kv_heads: int = 8,
                            head_dim: int = 128, block_size: int = 16) -> DecodeAttentionInputs:
    """Random bf16 inputs at Llama-8B's heads by default. One KV cache per layer, as in a model
    step: enough copies that rotating through them keeps the KV out of L2."""
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, kv_heads, head_dim)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
    caches = [(torch.randn(shape, device="cuda", dtype=BF16),
               torch.randn(shape, device="cuda", dtype=BF16))
              for _ in range(copies_to_defeat_l2(kv_bytes))]
    tables = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=BF16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return DecodeAttentionInputs(q, caches, tables, seq_lens, kv_bytes,
                                 num_splits_for(batch, kv_heads, context, sms))


def decode_attention_rows(batch: int, context: int, limits: DeviceLimits,
                          heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                          block_size: int = 16) -> list[dict]:
    inputs = decode_attention_inputs(batch, context, heads, kv_heads, head_dim, block_size)
    q, caches, tables, seq_lens = inputs.q, inputs.caches, inputs.tables, inputs.seq_lens
    kv_bytes, splits = inputs.kv_bytes, inputs.splits
    name = f"decode attention {batch}x{context}"
    what = f"{heads}q/{kv_heads}kv h{head_dim} blk{block_size}"
    rows = []
    meta = SimpleNamespace(block_tables=tables, seq_lens=seq_lens, max_seq_len=context)
    blocks_chosen = use_block_decode(q, *caches[0])
    kernels = [("triton", f"ours (Triton split-KV, {splits} splits)", not blocks_chosen)]
    if block_decode_supported(q, *caches[0], 1) is None:
        kernels.append(("blocks", "ours (CUDA whole-block)", blocks_chosen))
    for kernel, impl, chosen in kernels:  # as the engine calls them (its split rules)
        seconds = time_graphed(lambda i, kernel=kernel: decode_attention(
            q, *caches[i % len(caches)], meta, head_dim ** -0.5, kernel=kernel))
        rows.append(_row(name, what, impl, seconds, chosen,
                         copy_fraction=kv_bytes / seconds / limits.copy_bytes_per_s))
    unified = load_aiter_triton().unified_attention
    out = torch.empty_like(q)
    one = torch.ones(1, device="cuda")
    start_loc = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    aiter_s = time_graphed(lambda i: unified(
        q, *caches[i % len(caches)], out, cu_seqlens_q=start_loc, max_seqlen_q=1,
        seqused_k=seq_lens, max_seqlen_k=context, softmax_scale=head_dim ** -0.5, causal=True,
        window_size=(-1, -1), block_table=tables, softcap=0, q_descale=None, k_descale=one,
        v_descale=one))
    rows.append(_row(name, what, "AITER unified_attention", aiter_s, False,
                     copy_fraction=kv_bytes / aiter_s / limits.copy_bytes_per_s))
    return rows


# Llama-8B's projections: name -> (N, K, fused add+norm before it, SiLU*mul after it)
PROJECTIONS = {"qkv": (6144, 4096, True, False), "o": (4096, 4096, False, False),
               "gate_up": (28672, 4096, True, True), "down": (4096, 14336, False, False)}


def gemv_rows(rows: int, limits: DeviceLimits) -> list[dict]:
    """Each projection with the ops the batch-1 path fuses into it, cold weights:
    cuBLAS (F.linear) plus the separate norm / SiLU kernels, against fused_gemv."""
    out = []
    for name, (n, k, norm, silu) in PROJECTIONS.items():
        weights = [torch.randn(n, k, device="cuda", dtype=BF16) / k ** 0.5
                   for _ in range(copies_to_defeat_l2(n * k * 2))]
        x = torch.randn(rows, k, device="cuda", dtype=BF16)
        res = torch.randn_like(x)
        norm_op = RMSNorm(k, 1e-5, AITER).cuda().to(BF16)
        act = SiluAndMul(AITER)

        def unfused(i):
            h = norm_op(x, res)[0] if norm else x  # (writes res in place: timing only)
            y = F.linear(h, weights[i % len(weights)])
            return act(y) if silu else y

        def fused(i):
            return fused_gemv(x, weights[i % len(weights)], residual=res if norm else None,
                              norm_weight=norm_op.weight if norm else None, silu_mul=silu)
        what = f"{rows}x{k}x{n}" + (" +add+norm" if norm else "") + (" +silu" if silu else "")
        for impl, fn, chosen in (("cuBLAS + separate kernels", unfused, False),
                                 ("ours (fused GEMV)", fused, True)):
            seconds = time_graphed(fn)
            out.append(_row(f"projection {name}", what, impl, seconds, chosen,
                            copy_fraction=n * k * 2 / seconds / limits.copy_bytes_per_s))
        del weights
    return out


def op_rows(limits: DeviceLimits) -> list[dict]:
    rows: list[dict] = []
    rows += gemv_rows(1, limits)
    for batch in (1, 64):
        rows += norm_rows(batch)
        rows += activation_rope_rows(batch)
    for batch, context in ((1, 4096), (64, 4096), (8, 4096), (1, 1024), (64, 1024)):
        rows += decode_attention_rows(batch, context, limits)
    return rows
