"""Single-launch split-KV decode attention for Hopper (cuda/decode_cluster.cu), from Python.

An experiment, measured and kept for the next attempt; the engine does not call it. It was
built to close the batch-1 x 4k decode-attention target (60% of copy bandwidth = 9.5 us on an
H100) by replacing the Triton kernel's second launch (the combine, ~3.7 us in the chain) with a
reduction over distributed shared memory inside a thread-block cluster. Measured on an H100
(`python -m tandem.bench.cluster_decode`, bench/results/cluster-decode-h100.log):
  - 1 x 4k: 14.5 us at best (16 splits, 4 warps) against the Triton pair's 12.0 us;
  - 1 x 128, the fixed cost: 5.0 us against the Triton pair's 4.6 us: a cluster launch with
    its id staging, cluster barriers and DSMEM reads costs about what the second launch did;
  - where it wins: 8 x 4k 53 us (85%) against 57 us (80%), 1 x 1k 6.4 us against 7.0 us;
  - Hopper holds only 7 resident 16-CTA clusters of the 8-warp shape (14 of the 4-warp one),
    so 16 splits x 8 KV heads needs the small shape or runs in two waves;
  - streaming is bounded by bytes in flight per warp (registers hold them): 8 warps stream
    ~2x what 4 do at the same split count.
What might still close the gap: staging tiles in shared memory (cp.async) so more bytes are
in flight per SM than registers allow, and shaving the fixed cost (the id-staging round trip
before the first KV load). Both are open; see issue 5's session-6 note.

The kernel is CUDA C++ (Triton exposes no thread-block clusters or distributed shared memory).
It is built once per source version with the machine's `nvcc` into
$TANDEM_KERNEL_CACHE (default ~/.cache/tandem/kernels) and called through ctypes on torch's
current stream, so it is captured by CUDA graphs like any other launch. Where it cannot run
(no nvcc, not sm_90+, ROCm, an unsupported shape) `cluster_decode_supported` says why and the
caller keeps the Triton kernel (paged_decode.py); nothing here is required to serve.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from tandem.workers.ops.gpu.cuda_build import build_library
from tandem.workers.ops.gpu.pdl import pdl_enabled

HEAD_DIM = 128
GROUPS = (1, 2, 4, 8)          # query heads per KV head, as instantiated in the .cu
SHAPES = ((4, 2), (4, 4), (8, 1))  # (warps per CTA, tile buffers in shared memory), as built
MAX_SPLITS = 16                # Hopper's largest (non-portable) cluster
_DTYPES = {torch.bfloat16: 0, torch.float16: 1}


class _Params(ctypes.Structure):
    """Mirrors `Params` in decode_cluster.cu, field for field."""
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("q", "k_cache", "v_cache", "out", "block_tables", "seq_lens", "sinks")] + \
               [(name, ctypes.c_int64) for name in
                ("q_stride_tok", "q_stride_head", "k_stride_block", "k_stride_slot",
                 "k_stride_head", "v_stride_block", "v_stride_slot", "v_stride_head",
                 "out_stride_tok", "out_stride_head", "table_stride")] + \
               [("block_size", ctypes.c_int32), ("sliding_window", ctypes.c_int32),
                ("scale", ctypes.c_float)]


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The built library, or a sentence saying why there is none."""
    library = build_library("decode_cluster")
    if isinstance(library, str):
        return library
    library.tandem_decode_cluster_launch.restype = ctypes.c_int
    library.tandem_decode_cluster_launch.argtypes = [
        ctypes.POINTER(_Params)] + [ctypes.c_int] * 8 + [ctypes.c_void_p, ctypes.c_int]
    library.tandem_decode_cluster_max_active.restype = ctypes.c_int
    library.tandem_decode_cluster_max_active.argtypes = [ctypes.c_int] * 6
    return library


def cluster_decode_supported(q: torch.Tensor, k_cache: torch.Tensor,
                             num_splits: int) -> str | None:
    """None if `cluster_decode_attention` can run these inputs, else the reason it cannot."""
    if q.device.type != "cuda" or torch.version.cuda is None:
        return "needs an NVIDIA GPU"
    if torch.cuda.get_device_capability(q.device)[0] < 9:
        return "needs sm_90+ (thread-block clusters)"
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype:
        return f"needs bf16/fp16 q and cache, got {q.dtype}/{k_cache.dtype}"
    if q.shape[-1] != HEAD_DIM:
        return f"needs head_dim {HEAD_DIM}, got {q.shape[-1]}"
    group = q.shape[1] // k_cache.shape[2]
    if group not in GROUPS:
        return f"needs {GROUPS} query heads per KV head, got {group}"
    if num_splits > MAX_SPLITS or num_splits & (num_splits - 1):
        return f"needs a power-of-two split count <= {MAX_SPLITS}, got {num_splits}"
    library = _library()
    return library if isinstance(library, str) else None


def max_active_clusters(dtype: torch.dtype, group: int, num_splits: int, device: int = 0,
                        shape: tuple[int, int] = (4, 2)) -> int:
    """Clusters of `num_splits` CTAs the device can hold at once (occupancy API)."""
    library = _library()
    if isinstance(library, str):
        raise RuntimeError(library)
    return library.tandem_decode_cluster_max_active(_DTYPES[dtype], group, *shape, num_splits,
                                                    device)


def cluster_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                             *, num_splits: int, out: torch.Tensor | None = None,
                             sliding_window: int | None = None,
                             sinks: torch.Tensor | None = None,
                             shape: tuple[int, int] = (4, 2)) -> torch.Tensor:
    """Same contract as paged_decode.paged_decode_attention (q [B, H, 128] -> out [B, H, 128]),
    in one launch; the caller checks `cluster_decode_supported` first."""
    library = _library()
    if isinstance(library, str):
        raise RuntimeError(f"cluster decode attention unavailable: {library}")
    num_seqs, num_heads, _ = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("q and the KV caches need a contiguous head_dim")
    if out is None:
        out = torch.empty_like(q)
    if sinks is not None and sinks.dtype != torch.float32:
        sinks = sinks.float()
    params = _Params(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        block_tables.data_ptr(), seq_lens.data_ptr(),
        sinks.data_ptr() if sinks is not None else None,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        out.stride(0), out.stride(1), block_tables.stride(0),
        block_size, sliding_window or 0, scale)
    device = q.device.index or 0
    stream = torch.cuda.current_stream(q.device).cuda_stream
    status = library.tandem_decode_cluster_launch(
        ctypes.byref(params), _DTYPES[q.dtype], num_heads // num_kv_heads, *shape,
        num_seqs, num_kv_heads, num_splits, device, stream, int(pdl_enabled(q.device)))
    if status != 0:
        raise RuntimeError(f"cluster decode attention launch failed: CUDA error {status}")
    return out
