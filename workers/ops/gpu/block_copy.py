"""Copy KV blocks between two paged caches in one pass: dst[t, dst_ids[i]] = src[t, src_ids[i]]
for every cache tensor t, one launch for all tensors and blocks.

The source may be another GPU's memory mapped into this device's address space (CUDA IPC
with peer access): each program then reads the peer's HBM over NVLink and writes its local
block directly, so the bytes cross the link once and land without a staging copy (the torch
fallback, index_select then index_copy_, makes two passes).

Both sides are views [T, num_blocks, *block] whose blocks are contiguous runs of
`block_bytes` bytes; tensor t's block b starts at t * tensor_stride + b * block_stride bytes.
The kernel works on bytes, so any dtype copies bit for bit (NaN payloads included).

Launch cost: a plain `kernel[grid](...)` call spends tens of microseconds in Triton's Python
binder (argument specialization, cache key, launch metadata). BlockGather launches that way
once per device, keeps the CompiledKernel it returns, and then calls its launcher directly
with the same arguments in the same order. That is valid because nothing that selects the
compiled variant changes between launches of one BlockGather: pointers, strides and
constexprs are fixed at construction, and the two per-launch values are kept out of
specialization (num_pairs: do_not_specialize; the ids pointer: do_not_specialize_on_alignment).
The direct call is skipped (plain launch instead) when Triton's launch hooks are set (a
profiler), when the ids are not int32, for a stream of another device, and for good after a
TypeError from the launcher (another Triton's calling convention; raised before launching).
The call follows Triton 3.6's JITFunction.run; a Triton without triton.knobs (older ones,
whose launchers took other arguments) always launches the plain way.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import triton
import triton.language as tl

try:  # older Tritons have no knobs (and another launcher convention): plain launches
    from triton import knobs
except ImportError:
    knobs = None

# Bytes one program moves: each of 4 warps' threads issues 4 x 16-byte loads before its first
# store. Over NVLink between two H200s (64 tensors x 32 KiB blocks) 8-32 KiB chunks and 4-16
# warps are within ~5% of each other at 256 MiB; 8 KiB x 4 warps is best or tied at 16-64 MiB.
CHUNK_BYTES = 8192
NUM_WARPS = 4


# The per-launch values stay out of specialization, so one compiled variant serves every launch
# of a BlockGather (the direct launch relies on it; num_pairs == 1 would otherwise compile a
# variant with num_pairs as a constant).
#
# One flat grid, program p = (pair, tensor, chunk) with the chunk fastest: programs that run at
# the same time walk the same block's bytes in order (in a block-major cache a block of every
# tensor is one contiguous run), rather than the same chunk of many blocks far apart.
@triton.jit(do_not_specialize=["num_pairs"], do_not_specialize_on_alignment=["ids_ptr"])
def _gather_blocks_kernel(src_ptr, dst_ptr, ids_ptr, num_pairs,
                          src_tensor_stride, dst_tensor_stride,
                          src_block_stride, dst_block_stride, block_bytes,
                          NUM_TENSORS: tl.constexpr, NUM_CHUNKS: tl.constexpr,
                          CHUNK: tl.constexpr, ALIGNED: tl.constexpr):
    program = tl.program_id(0)
    chunk = program % NUM_CHUNKS
    tensor = ((program // NUM_CHUNKS) % NUM_TENSORS).to(tl.int64)
    pair = program // (NUM_CHUNKS * NUM_TENSORS)
    src_block = tl.load(ids_ptr + pair).to(tl.int64)
    dst_block = tl.load(ids_ptr + num_pairs + pair).to(tl.int64)
    src_start = tensor * src_tensor_stride + src_block * src_block_stride
    dst_start = tensor * dst_tensor_stride + dst_block * dst_block_stride
    if ALIGNED:  # every block start is 16-byte aligned: 16-byte vector loads and stores
        src_start = tl.multiple_of(src_start, 16)
        dst_start = tl.multiple_of(dst_start, 16)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_bytes
    data = tl.load(src_ptr + src_start + offs, mask=mask)
    tl.store(dst_ptr + dst_start + offs, data, mask=mask)


class BlockGather:
    """gather(ids, stream) launches the copy src[:, ids[0]] -> dst[:, ids[1]] on `stream`
    (default: the current stream).

    src, dst: [T, num_blocks, ...] views (same T and block shape, each block contiguous).
    Everything but the ids is checked and computed once here; after the first launch on a
    device a launch is one direct call of the compiled kernel's launcher (module docstring)."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if src.shape[0] != dst.shape[0] or src.shape[2:] != dst.shape[2:]:
            raise ValueError(f"block gather: source {tuple(src.shape)} and destination "
                             f"{tuple(dst.shape)} differ beyond the block count")
        if src.dtype != dst.dtype:
            raise ValueError(f"block gather: dtypes differ ({src.dtype} vs {dst.dtype})")
        for t in (src, dst):
            if not t[0, 0].is_contiguous():
                raise ValueError("block gather: a block must be one contiguous run")
        item = src.element_size()
        self.num_tensors = src.shape[0]
        self.block_bytes = src[0, 0].numel() * item
        self.num_chunks = triton.cdiv(self.block_bytes, CHUNK_BYTES)
        self.strides = (src.stride(0) * item, dst.stride(0) * item, src.stride(1) * item,
                        dst.stride(1) * item)
        # Byte views whose data_ptr is each view's first element (only the pointer is used);
        # they keep the storages alive as long as this object.
        self.src_bytes = _byte_base(src)
        self.dst_bytes = _byte_base(dst)
        self.aligned = all(s % 16 == 0 for s in self.strides) and (
            src.data_ptr() % 16 == 0 and dst.data_ptr() % 16 == 0)
        self._direct_ok = dst.device.type == "cuda" and knobs is not None  # else plain only
        # The direct launch's arguments but the ids and num_pairs (launch_args). The base
        # pointers go as ints (device addresses; the storages live in src/dst_bytes).
        self._base_ptrs = (self.src_bytes.data_ptr(), self.dst_bytes.data_ptr())
        self._tail_args = (*self.strides, self.block_bytes, self.num_tensors, self.num_chunks,
                           CHUNK_BYTES, self.aligned)
        self._compiled: dict[int, object] = {}  # device index -> CompiledKernel
        self.direct_launches = 0  # launches that took the direct path (tests, bench)

    def __call__(self, ids: torch.Tensor, stream: torch.cuda.Stream | None = None) -> None:
        """ids: int32 [2, n] contiguous, on the destination's device or in pinned host memory
        (read in place until the copy completed: keep it alive and unchanged till then)."""
        num_pairs = ids.shape[1]
        if num_pairs == 0:
            return
        if self._direct_ok:
            device = torch.cuda.current_device()
            kernel = self._compiled.get(device)
            if kernel is not None and ids.dtype == torch.int32 and not _launch_hooks_set():
                if stream is None:
                    stream = torch.cuda.current_stream(device)
                if stream.device_index == device:
                    try:
                        kernel.run(self._programs(num_pairs), 1, 1, stream.cuda_stream,
                                   kernel.function, kernel.packed_metadata, None, None, None,
                                   *self.launch_args(ids, num_pairs))
                        self.direct_launches += 1
                        return
                    except TypeError:  # another calling convention: nothing was launched
                        self._compiled.clear()
                        self._direct_ok = False
        self._plain_launch(ids, num_pairs, stream)

    def precompile(self) -> None:
        """Compiles the kernel variant this gather launches, without launching it (a decode
        worker calls it at startup, so its first handoff does not wait for Triton)."""
        ids = torch.zeros((2, 1), dtype=torch.int32, device=self.dst_bytes.device)
        _gather_blocks_kernel.warmup(*self._jit_args(ids, 1), **self._jit_options,
                                     grid=(self._programs(1), 1, 1))

    def launch_args(self, ids: torch.Tensor, num_pairs: int) -> tuple:
        """The kernel's arguments in its parameter order, constexprs included (as Triton's
        launcher takes them), pointers to the caches as ints."""
        return (*self._base_ptrs, ids, num_pairs, *self._tail_args)

    def _jit_args(self, ids: torch.Tensor, num_pairs: int) -> tuple:
        """The kernel's runtime arguments as Triton's JIT entry takes them (tensors)."""
        return (self.src_bytes, self.dst_bytes, ids, num_pairs, *self.strides,
                self.block_bytes)

    @property
    def _jit_options(self) -> dict:
        """Constexprs and launch options: with _jit_args, what selects the compiled variant."""
        return dict(NUM_TENSORS=self.num_tensors, NUM_CHUNKS=self.num_chunks, CHUNK=CHUNK_BYTES,
                    ALIGNED=self.aligned, num_warps=NUM_WARPS)

    def _programs(self, num_pairs: int) -> int:
        """The flat grid: a program per (pair, tensor, chunk)."""
        return num_pairs * self.num_tensors * self.num_chunks

    def _plain_launch(self, ids: torch.Tensor, num_pairs: int,
                      stream: torch.cuda.Stream | None) -> None:
        """Triton's own launch path; keeps the compiled kernel for direct launches."""
        grid = (self._programs(num_pairs),)
        on_stream = torch.cuda.stream(stream) if stream is not None else nullcontext()
        with on_stream:
            kernel = _gather_blocks_kernel[grid](*self._jit_args(ids, num_pairs),
                                                 **self._jit_options)
            if (self._direct_ok and ids.dtype == torch.int32
                    and getattr(kernel, "function", None) is not None
                    and hasattr(kernel, "packed_metadata")):
                self._compiled[torch.cuda.current_device()] = kernel


def _launch_hooks_set() -> bool:
    """Whether a profiler hooked Triton's launches (3.6: HookChains, earlier: callables)."""
    runtime = knobs.runtime
    return any(getattr(hook, "calls", hook) for hook in (runtime.launch_enter_hook,
                                                          runtime.launch_exit_hook))


def _byte_base(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        t.untyped_storage(), t.storage_offset() * t.element_size(), (1,))
