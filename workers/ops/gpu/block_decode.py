"""Decode attention whose split pass reads whole cache blocks by bulk copy
(cuda/decode_blocks.cu), then a CUDA combine (cuda/decode_combine.cuh): from Python.

The split pass moves each cache slot (every KV head, kv_heads x 256 bytes) into shared memory
with one TMA bulk copy; the .cu says why, how, and what it measures. It needs the cache's
slots and heads contiguous within a block (the engine's [num_blocks, block_size, kv_heads,
128] layout, per layer, blocks at any stride), head_dim 128, 2/4/8 KV heads, 1/2/4/8 query
heads per KV head, block_size a multiple of 16, bf16/fp16, an NVIDIA sm_90+ GPU and nvcc
(cuda_build.py). `block_decode_supported` says why not otherwise, and the caller keeps
paged_decode.py.

Given the step's raw new keys (NewKeys), the split pass also applies the step's QK norm and
RoPE to q and the new K and writes the new K / V rows to the cache (cuda/decode_rope.cuh),
so no RoPE + KV-write launch runs before it; `new_keys_reason` says where it cannot.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from tandem.workers.ops.gpu.cuda_build import build_library
from tandem.workers.ops.gpu.pdl import pdl_enabled
from tandem.workers.ops.gpu.rope import QKNorm, fuses_qk_norm

HEAD_DIM = 128
GROUPS = (1, 2, 4, 8)   # query heads per KV head, as instantiated in the .cu
KV_HEADS = (2, 4, 8)    # warps per CTA, one per KV head
MAX_SPLITS = 256        # kCombineMaxSplits in decode_combine.cuh
MAX_STAGES = 8          # kMaxStages in the .cu
SHARED_BUDGET = 200 * 1024  # bytes of block buffers per CTA (one CTA per SM)
# From this many splits up, slots are copied one each to padded rows (conflict-free operand
# loads); below it, one copy per block streams faster.
PADDED_SPLITS = 32
_DTYPES = {torch.bfloat16: 0, torch.float16: 1}


class _Params(ctypes.Structure):
    """Mirrors `Params` in decode_blocks.cu, field for field."""
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "part_out",
                 "part_lse")] + \
               [(name, ctypes.c_int64) for name in
                ("q_stride_tok", "q_stride_head", "k_stride_block", "v_stride_block",
                 "table_stride")] + \
               [(name, ctypes.c_int32) for name in
                ("table_width", "block_size", "sliding_window", "stages", "padded")] + \
               [("scale", ctypes.c_float), ("trace", ctypes.c_void_p)] + \
               [(name, ctypes.c_void_p) for name in
                ("k_new", "v_new", "positions", "slot_mapping", "cos", "sin", "q_norm",
                 "k_norm")] + \
               [(name, ctypes.c_int64) for name in
                ("k_new_stride_tok", "k_new_stride_head", "v_new_stride_tok",
                 "v_new_stride_head", "rope_stride")] + \
               [("rope", ctypes.c_int32), ("norm_eps", ctypes.c_float)]


_ROPE_STYLES = {True: 1, False: 2}  # is_neox_style -> RopeStyle in cuda/decode_rope.cuh


@dataclass(frozen=True)
class NewKeys:
    """A decode step's new keys for block_decode_attention to norm, rotate and cache itself
    (cuda/decode_rope.cuh), in place of rope.rope_and_write_kv before it: q is then the qkv
    projection's raw output. k, v [B, KVH, 128] raw; positions and slot_mapping [B] int64
    (slot < 0: a padding row, not cached); cos / sin [max_position, 64] fp32 (rotary tables,
    full rotary only); qk_norm (q weight [128], k weight [128], eps) or None."""
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    is_neox_style: bool
    qk_norm: QKNorm | None = None


def new_keys_reason(q: torch.Tensor, new: NewKeys) -> str | None:
    """None if block_decode_attention can take `new` with these q, else why not (the caller
    then runs rope_and_write_kv first)."""
    if tuple(new.cos.shape[1:]) != (HEAD_DIM // 2,) or new.sin.shape != new.cos.shape:
        return f"needs full rotary over {HEAD_DIM} dims, got cos {tuple(new.cos.shape)}"
    if new.cos.dtype != torch.float32 or new.sin.dtype != torch.float32 \
            or new.cos.stride(1) != 1 or new.sin.stride() != new.cos.stride():
        return "needs fp32 cos / sin tables with contiguous rows of one stride"
    if new.positions.dtype != torch.int64 or new.slot_mapping.dtype != torch.int64 \
            or new.positions.stride(0) != 1 or new.slot_mapping.stride(0) != 1:
        return "needs contiguous int64 positions and slots"
    for x in (new.k, new.v):
        if x.dtype != q.dtype or x.shape[0] != q.shape[0] or x.shape[2] != HEAD_DIM \
                or x.stride(2) != 1 or x.stride(0) % 8 or x.stride(1) % 8 \
                or x.data_ptr() % 16:
            return "needs new K / V rows in q's dtype, 16-byte aligned, head_dim contiguous"
    if new.qk_norm is not None and (not fuses_qk_norm(q, HEAD_DIM // 2, new.qk_norm)
                                    or any(w.stride(0) != 1 for w in new.qk_norm[:2])):
        return "needs contiguous [128] QK-norm weights in q's dtype"
    if q.stride(0) % 8 or q.stride(1) % 8 or q.data_ptr() % 16:
        return "needs 16-byte aligned q rows"
    return None


class _CombineParams(ctypes.Structure):
    """Mirrors `CombineParams` in decode_combine.cuh, field for field."""
    _fields_ = [(name, ctypes.c_void_p) for name in ("part_out", "part_lse", "sinks", "out")] + \
               [(name, ctypes.c_int64) for name in ("out_stride_tok", "out_stride_head")] + \
               [("num_splits", ctypes.c_int32), ("trace", ctypes.c_void_p)]


@functools.cache
def _library() -> ctypes.CDLL | str:
    library = build_library("decode_blocks")
    if isinstance(library, str):
        return library
    library.tandem_decode_blocks_launch.restype = ctypes.c_int
    library.tandem_decode_blocks_launch.argtypes = [
        ctypes.POINTER(_Params), ctypes.POINTER(_CombineParams)] + [ctypes.c_int] * 7 + \
        [ctypes.c_void_p, ctypes.c_int]
    return library


def _stage_bytes(block_size: int, kv_heads: int, padded: bool = True) -> int:
    slot = kv_heads * HEAD_DIM * 2
    if not padded:
        return block_size * 2 * slot
    return block_size * ((slot + 64) + (slot + 16))  # padded pitches (kKPitch, kVPitch)


def block_decode_supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           num_splits: int) -> str | None:
    """None if `block_decode_attention` can run these inputs, else the reason it cannot."""
    return layout_reason(q.device, q.dtype, q.shape[1], tuple(k_cache.shape), k_cache.stride(),
                         v_cache.stride(), k_cache.dtype, v_cache.dtype, num_splits)


@functools.cache
def layout_reason(device: torch.device, dtype: torch.dtype, num_heads: int,
                  cache_shape: tuple[int, ...], k_stride: tuple[int, ...],
                  v_stride: tuple[int, ...], k_dtype: torch.dtype, v_dtype: torch.dtype,
                  num_splits: int = 1) -> str | None:
    """block_decode_supported from the inputs' layout alone (no tensors needed)."""
    if device.type != "cuda" or torch.version.cuda is None:
        return "needs an NVIDIA GPU"
    if torch.cuda.get_device_capability(device)[0] < 9:
        return "needs sm_90+ (TMA bulk copies)"
    if dtype not in _DTYPES or k_dtype != dtype or v_dtype != dtype:
        return f"needs bf16/fp16 q and caches, got {dtype}/{k_dtype}/{v_dtype}"
    _, block_size, kv_heads, head_dim = cache_shape
    if head_dim != HEAD_DIM:
        return f"needs head_dim {HEAD_DIM}, got {head_dim}"
    if kv_heads not in KV_HEADS or num_heads % kv_heads or num_heads // kv_heads not in GROUPS:
        return (f"needs {KV_HEADS} KV heads with {GROUPS} query heads each, got {kv_heads} "
                f"KV / {num_heads} query heads")
    if block_size % 16:
        return f"needs a block size that is a multiple of 16, got {block_size}"
    for stride in (k_stride, v_stride):
        if tuple(stride[1:]) != (kv_heads * HEAD_DIM, HEAD_DIM, 1) or stride[0] % 8:
            return f"needs slots and heads contiguous within a block, got strides {stride}"
    if not 1 <= num_splits <= MAX_SPLITS:
        return f"needs a split count in 1..{MAX_SPLITS}, got {num_splits}"
    if _stage_bytes(block_size, kv_heads) > SHARED_BUDGET:
        return f"one block of {block_size} slots x {kv_heads} heads overflows shared memory"
    library = _library()
    return library if isinstance(library, str) else None


def block_splits_for(num_seqs: int, max_seq_len: int, block_size: int, num_sms: int) -> int:
    """Splits per sequence: at most one CTA per SM in one wave, never more splits than blocks;
    a lone sequence takes half the SMs, so that each CTA streams ~4 blocks through its buffers
    while the producer warp keeps the TMA queue full, which is faster than one CTA per SM for
    a lone sequence and slower for 8 (bench/RESULTS.md, block decode). Depends only on the
    batch shape and the longest context, so a CUDA graph captured for a batch size stays
    valid at every length."""
    blocks = max(1, -(-max_seq_len // block_size))
    wave = num_sms // 2 if num_seqs == 1 else num_sms // max(1, num_seqs)
    return max(1, min(wave, blocks, MAX_SPLITS))


def block_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           *, num_splits: int, out: torch.Tensor | None = None,
                           sliding_window: int | None = None,
                           sinks: torch.Tensor | None = None,
                           stages: int | None = None, padded: bool | None = None,
                           trace: tuple[torch.Tensor, torch.Tensor] | None = None,
                           new_keys: NewKeys | None = None) -> torch.Tensor:
    """Same contract as paged_decode.paged_decode_attention (q [B, H, 128] -> out [B, H, 128]);
    the caller checks `block_decode_supported` first. stages: block buffers per CTA (default:
    as many as fit SHARED_BUDGET, at most MAX_STAGES). padded: slots at padded pitches, one
    copy each (conflict-free operand loads) or one copy per block (default: padded from
    PADDED_SPLITS splits up). trace: int64 tensors
    [num_seqs * num_splits, 5] and [num_seqs * num_heads * 4, 5] the kernels fill with
    %globaltimer stamps (bench/probes/block_decode.py --timeline). new_keys: q is raw and
    this launch also applies the step's QK norm and RoPE and writes its new K / V to the
    caches (NewKeys; the caller checks `new_keys_reason` first)."""
    library = _library()
    if isinstance(library, str):
        raise RuntimeError(f"block decode attention unavailable: {library}")
    num_seqs, num_heads, _ = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if padded is None:
        padded = num_splits >= PADDED_SPLITS
    stage_bytes = _stage_bytes(block_size, kv_heads, padded)
    if stages is None:
        stages = min(MAX_STAGES, SHARED_BUDGET // stage_bytes)
    if q.stride(2) != 1:
        raise ValueError("q needs a contiguous head_dim")
    if out is None:
        out = torch.empty_like(q)
    if out.stride(2) != 1:
        raise ValueError("out needs a contiguous head_dim")
    if sinks is not None:
        sinks = sinks.float().contiguous()
    part_out = torch.empty(num_seqs, num_heads, num_splits, HEAD_DIM, dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32,
                           device=q.device)
    params = _Params(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        seq_lens.data_ptr(), part_out.data_ptr(), part_lse.data_ptr(),
        q.stride(0), q.stride(1), k_cache.stride(0), v_cache.stride(0), block_tables.stride(0),
        block_tables.shape[1], block_size, sliding_window or 0, stages, int(padded), scale,
        trace[0].data_ptr() if trace is not None else None, *_new_key_fields(new_keys))
    combine = _CombineParams(
        part_out.data_ptr(), part_lse.data_ptr(), sinks.data_ptr() if sinks is not None else None,
        out.data_ptr(), out.stride(0), out.stride(1), num_splits,
        trace[1].data_ptr() if trace is not None else None)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    status = library.tandem_decode_blocks_launch(
        ctypes.byref(params), ctypes.byref(combine), _DTYPES[q.dtype], kv_heads,
        num_heads // kv_heads, num_seqs, num_splits, stages * stage_bytes, q.device.index or 0,
        stream, int(pdl_enabled(q.device)))
    if status != 0:
        raise RuntimeError(f"block decode attention launch failed: status {status}")
    return out


def _new_key_fields(new: NewKeys | None) -> tuple:
    """_Params' RoPE fields, from `k_new` on: zeros and rope 0 (kRopeNone) without new_keys."""
    if new is None:
        return (None,) * 8 + (0,) * 5 + (0, 0.0)
    q_weight, k_weight, eps = new.qk_norm if new.qk_norm is not None else (None, None, 0.0)
    pointers = [t.data_ptr() if t is not None else None for t in
                (new.k, new.v, new.positions, new.slot_mapping, new.cos, new.sin, q_weight,
                 k_weight)]
    return (*pointers, new.k.stride(0), new.k.stride(1), new.v.stride(0), new.v.stride(1),
            new.cos.stride(0), _ROPE_STYLES[new.is_neox_style], eps)
