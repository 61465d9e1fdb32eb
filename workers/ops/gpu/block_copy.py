"""Copy KV blocks between two paged caches in one pass: dst[t, dst_ids[i]] = src[t, src_ids[i]]
for every cache tensor t, one launch for all tensors and blocks.

The source may be another GPU's memory mapped into this device's address space (CUDA IPC
with peer access): each program then reads the peer's HBM over NVLink and writes its local
block directly, so the bytes cross the link once and land without a staging copy (the torch
fallback, index_select then index_copy_, makes two passes).

Both sides are views [T, num_blocks, *block] whose blocks are contiguous runs of
`block_bytes` bytes; tensor t's block b starts at t * tensor_stride + b * block_stride bytes.
The kernel works on bytes, so any dtype copies bit for bit (NaN payloads included).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Bytes one program moves: each of 4 warps' threads issues 4 x 16-byte loads before its first
# store. Swept on 2 H200s (cuda:1 reading cuda:0 over NVLink, 64 tensors x 32 KiB blocks;
# bench/results/gather-explore-h200x2.log): 8-32 KiB chunks and 4-16 warps are within ~5% at
# 256 MiB (0.93x the copy engine's 1 GiB rate); 8 KiB x 4 warps is best or tied at 16-64 MiB.
CHUNK_BYTES = 8192
NUM_WARPS = 4


@triton.jit
def _gather_blocks_kernel(src_ptr, dst_ptr, ids_ptr, num_pairs,
                          src_tensor_stride, dst_tensor_stride,
                          src_block_stride, dst_block_stride, block_bytes,
                          CHUNK: tl.constexpr, ALIGNED: tl.constexpr):
    pair = tl.program_id(0)
    tensor = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
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
    """gather(ids) launches the copy src[:, ids[0]] -> dst[:, ids[1]] on the current stream.

    src, dst: [T, num_blocks, ...] views (same T and block shape, each block contiguous).
    Everything but the ids is checked and computed once here, so a launch costs one Triton
    call (the per-handle path of a decode worker)."""

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
        self.strides = (src.stride(0) * item, dst.stride(0) * item, src.stride(1) * item,
                        dst.stride(1) * item)
        # Byte views whose data_ptr is each view's first element (only the pointer is used);
        # they keep the storages alive as long as this object.
        self.src_bytes = _byte_base(src)
        self.dst_bytes = _byte_base(dst)
        self.aligned = all(s % 16 == 0 for s in self.strides) and (
            src.data_ptr() % 16 == 0 and dst.data_ptr() % 16 == 0)

    def __call__(self, ids: torch.Tensor) -> None:
        """ids: int32 [2, n] contiguous, on the destination's device or in pinned host memory
        (read in place; keep it alive until the copy completed)."""
        num_pairs = ids.shape[1]
        if num_pairs == 0:
            return
        grid = (num_pairs, self.num_tensors, triton.cdiv(self.block_bytes, CHUNK_BYTES))
        _gather_blocks_kernel[grid](self.src_bytes, self.dst_bytes, ids, num_pairs,
                                    *self.strides, self.block_bytes, CHUNK=CHUNK_BYTES,
                                    ALIGNED=self.aligned, num_warps=NUM_WARPS)


def _byte_base(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        t.untyped_storage(), t.storage_offset() * t.element_size(), (1,))
