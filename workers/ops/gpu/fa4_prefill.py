"""Prefill attention through FlashAttention-4's Hopper kernel, where it is installed.

    if fa4_takes_fresh(q, k, num_seqs, num_tokens, sliding_window):   # nothing cached yet
        out = fa4_prefill_attention(q, k, v, cu_seqlens, max_seqlen, scale)
    if fa4_takes_paged(q, k_cache, num_tokens, sliding_window):      # over cached context
        out = fa4_paged_prefill_attention(q, k_cache, v_cache, meta, scale)

FlashAttention-4 (the `flash-attn-4` package, `pip install tandem[hopper]`) is a
warp-specialized attention forward written in CuTe DSL: one launch covers every sequence of the
step (cu_seqlens, as varlen), reads GQA keys in place, reads a paged KV cache through the block
tables, and JIT-compiles one kernel per head layout, dtype and form (fresh or paged) on its
first call (a few seconds; the worker's warm-up makes those calls).

Which prefills take it (on an H100, bench/RESULTS.md):
- fresh prompts (nothing cached), against torch SDPA's cuDNN kernel, which the engine otherwise
  runs once per sequence: several sequences in one step (one launch instead of one SDPA call
  per sequence, whose host cost, about 0.1 ms a call, dominates short prompts), or a lone prompt
  of at least LONE_MIN_TOKENS tokens, where the kernel itself is faster. Below that cuDNN's lone
  call is shorter than FA4's launch.
- steps that continue over cached context (prefix-cache hits, later chunks of a long prompt),
  against AITER's unified_attention: at least PAGED_MIN_TOKENS new tokens in the step, where
  FA4 takes about half the time; a few tokens over a long context stay on unified_attention.

Only compute capability 9.x (the kernel this module tunes; Blackwell's FA4 kernels are not
measured here), bf16 / fp16, head dims FA4 accepts on Hopper, full causal attention (no sliding
window, no sinks). KernelOptions.fa4_prefill (TANDEM_FA4_PREFILL=0) turns it off.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tandem.common.logging import get_logger
from tandem.workers.ops import kernel_options

if TYPE_CHECKING:
    from tandem.workers.ops.attention import AttentionMetadata

logger = get_logger(__name__)

LONE_MIN_TOKENS = 4096
PAGED_MIN_TOKENS = 256
# Launch settings per head dim where one measured faster than FA4's own choice, for fresh
# prompts: for 128, tiles of 192 queries x 128 keys with P staged through shared memory (not
# registers) for P @ V. Over a paged cache FA4's own choice is the faster.
_TUNED_FRESH = {128: {"tile_mn": (192, 128), "mma_pv_is_rs": False}}


def fa4_takes_fresh(q: torch.Tensor, k: torch.Tensor, num_seqs: int, num_tokens: int,
                    sliding_window: int | None) -> bool:
    """Whether a fresh prefill (q [T, H, D], k [T, KVH, D]; nothing cached) runs on FA4
    (module docstring)."""
    if num_seqs == 1 and num_tokens < LONE_MIN_TOKENS:
        return False
    return _takes("fresh", q, k, sliding_window)


def fa4_takes_paged(q: torch.Tensor, k_cache: torch.Tensor, num_tokens: int,
                    sliding_window: int | None) -> bool:
    """Whether a prefill over cached context (q [T, H, D], k_cache [blocks, block size, KVH,
    D]) runs on FA4 (module docstring)."""
    return num_tokens >= PAGED_MIN_TOKENS and _pages_in_place(k_cache) \
        and _takes("paged", q, k_cache, sliding_window)


def _pages_in_place(cache: torch.Tensor) -> bool:
    """Whether FA4 reads this cache where it is: each block one dense run of [block size, KVH,
    D] and 16-byte aligned, whatever the stride between blocks (the engine's caches are views
    of one block-major allocation of every layer, engine/model_runner.py). Anything else FA4
    would first copy whole."""
    _, block, heads, dim = cache.shape
    return cache.stride()[1:] == (heads * dim, dim, 1) \
        and cache.stride(0) * cache.element_size() % 16 == 0 and cache.data_ptr() % 16 == 0


def _takes(form: str, q: torch.Tensor, k: torch.Tensor, sliding_window: int | None) -> bool:
    """What every FA4 path needs. Cheap checks first: FA4 is imported (seconds) only for a
    step that would take it."""
    if not q.is_cuda or sliding_window is not None or q.dtype not in (torch.bfloat16,
                                                                      torch.float16):
        return False
    head_dim = q.shape[-1]
    if head_dim % 8 or not 8 <= head_dim <= 256 or k.shape[-1] != head_dim:
        return False
    if q.stride(-1) != 1 or k.stride(-1) != 1 or _layout(form, q, k) in _refused:
        return False
    return _device_takes(q.device.index or 0) and _forward() is not None


# Layouts (form, dtype, head dim, query heads, KV heads) whose first FA4 call ran, and those
# whose first call raised (a layout this FA4 release does not build, found at warm-up): those
# stay on the default kernels for the life of the process, said once in the log.
_ran: set[tuple] = set()
_refused: set[tuple] = set()
num_calls = 0  # FA4 launches in this process that returned an output (bench, tests)


def _layout(form: str, q: torch.Tensor, k: torch.Tensor) -> tuple:
    return form, q.dtype, q.shape[-1], q.shape[-2], k.shape[-2]


def _call(form: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          **kwargs) -> torch.Tensor | None:
    """FA4's output for these arguments; None where this layout's first call raised. A
    layout that ran once raises as any kernel does."""
    global num_calls
    layout = _layout(form, q, k)
    try:
        out = _forward()(q, k, v, **kwargs)[0]  # the output; the log-sum-exp is not asked for
    except Exception as error:
        if layout in _ran:
            raise
        _refused.add(layout)  # its compile or argument checks refused this layout
        logger.warning("FlashAttention-4 does not run %s prefills of %d query / %d KV heads "
                       "of %d in %s (%s: %s); they stay on the default attention kernels",
                       form, layout[3], layout[4], layout[2], layout[1], type(error).__name__,
                       error)
        return None
    _ran.add(layout)
    num_calls += 1
    return out


@functools.cache
def _device_takes(device_index: int) -> bool:
    if not kernel_options.current().fa4_prefill or torch.version.cuda is None:
        return False
    return torch.cuda.get_device_capability(device_index)[0] == 9


@functools.cache
def _forward() -> Callable | None:
    """FA4's forward entry point, or None where the package is missing or does not load (then
    prefills keep torch SDPA and unified_attention; said once in the log)."""
    try:
        from flash_attn.cute import interface
    except Exception as error:  # ImportError, or a native library that fails to load
        logger.info("prefill attention stays on torch SDPA and unified_attention: "
                    "FlashAttention-4 is not available (%s: %s)", type(error).__name__, error)
        return None
    forward = getattr(interface, "_flash_attn_fwd", None)
    if forward is None or not {"tile_mn", "mma_pv_is_rs"} <= set(
            inspect.signature(forward).parameters):
        # A release whose internal entry point moved: its public function, at its defaults.
        public = interface.flash_attn_varlen_func

        def forward(q, k, v, **kwargs):
            for tuning in ("tile_mn", "mma_pv_is_rs"):
                kwargs.pop(tuning, None)
            result = public(q, k, v, **kwargs)
            return result if isinstance(result, tuple) else (result,)
    logger.info("prefill attention: FlashAttention-4 (flash-attn-4 %s) for fresh prompts, "
                "several in a step or one of %d tokens and more, and for steps of %d new "
                "tokens and more over cached context", _version(), LONE_MIN_TOKENS,
                PAGED_MIN_TOKENS)
    return forward


def fa4_in_use(device: torch.device) -> str | None:
    """The flash-attn-4 release this device's prefills run on (bf16 / fp16 layers of the
    aiter-triton backend, per the rules above), or None where they never take it."""
    if device.type != "cuda" or not _device_takes(device.index or 0) or _forward() is None:
        return None
    return f"flash-attn-4 {_version()}"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flash-attn-4")
    except PackageNotFoundError:
        return "unknown version"


def fa4_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cu_seqlens: torch.Tensor, max_seqlen: int,
                          scale: float) -> torch.Tensor | None:
    """Causal attention of each sequence over its own keys: q [T, H, D], k / v [T, KVH, D]
    (rows may be strided, each row's elements contiguous), cu_seqlens int32 [N + 1] on the
    device, max_seqlen the longest sequence. Returns a new [T, H, D] tensor, or None where FA4
    refused this layout (the caller runs its default kernel). Call only where fa4_takes_fresh
    said yes."""
    return _call("fresh", q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                 max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, softmax_scale=scale,
                 causal=True, **_TUNED_FRESH.get(q.shape[-1], {}))


def fa4_paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                meta: AttentionMetadata, scale: float) -> torch.Tensor | None:
    """Causal attention of each sequence's new tokens over all its keys in the paged cache
    (this step's already written): q [T, H, D], caches [blocks, block size, KVH, D], and the
    step's query_start_loc, seq_lens and block_tables (a sequence's queries are its last keys).
    Returns a new [T, H, D] tensor, or None where FA4 refused this layout. Call only where
    fa4_takes_paged said yes."""
    return _call("paged", q, k_cache, v_cache, cu_seqlens_q=meta.query_start_loc,
                 seqused_k=meta.seq_lens, page_table=meta.block_tables,
                 max_seqlen_q=meta.max_query_len, softmax_scale=scale, causal=True)
