"""A decode step's inputs into the static buffers its CUDA graph reads, in one launch.

engine/cuda_graphs.DecodeGraphs replays a graph captured over fixed buffers (token ids,
positions, KV slots, sequence lengths, block tables); each step's values must be copied into
them first, and a batch smaller than its graph pads the rows past it. As separate torch copies
and fills that is five to ten launches per step, each several microseconds of host time in
which an idle GPU waits before the replay and, when the host runs ahead, a short kernel of its
own between two replays. One program per row of the graph instead:

    row < batch   ids, position, slot, length and the first `width` table entries copied
    row >= batch  padding: id 0, position 0, slot -1 (the KV write skips it), length 1, and a
                  table row of zeros (it reads block 0 and its output is dropped)

Rows at or past `size` and a real row's table entries past `width` are left as they are: no
kernel reads a table entry past its sequence's blocks.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256  # table entries per step of a program's loop


@triton.jit(do_not_specialize=["batch", "width", "table_stride"])  # one variant for all steps
def _graph_inputs_kernel(ids_ptr, pos_ptr, slots_ptr, lens_ptr, tables_ptr,
                         ids_out, pos_out, slots_out, lens_out, tables_out,
                         batch, width, table_stride, out_stride, out_width,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0)
    real = row < batch
    src_row = tl.minimum(row, batch - 1)  # a padding row reads the last real one, unused
    tl.store(ids_out + row, tl.where(real, tl.load(ids_ptr + src_row), 0))
    tl.store(pos_out + row, tl.where(real, tl.load(pos_ptr + src_row), 0))
    tl.store(slots_out + row, tl.where(real, tl.load(slots_ptr + src_row), -1))
    tl.store(lens_out + row, tl.where(real, tl.load(lens_ptr + src_row), 1))
    copied = tl.where(real, tl.minimum(width, out_width), 0)  # entries read from the batch
    entries = tl.where(real, copied, out_width)  # entries written
    src = tables_ptr + src_row.to(tl.int64) * table_stride
    dst = tables_out + row.to(tl.int64) * out_stride
    for start in range(0, entries, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        tl.store(dst + cols, tl.load(src + cols, mask=cols < copied, other=0),
                 mask=cols < entries)


def copy_graph_inputs(input_ids: torch.Tensor, positions: torch.Tensor,
                      slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
                      block_tables: torch.Tensor, static: tuple[torch.Tensor, ...],
                      size: int) -> None:
    """A batch's inputs (input_ids, positions, slot_mapping [B] int64, seq_lens [B] int32,
    block_tables [B, width] int32; each vector and table row contiguous) into rows 0..size-1
    of the graph's static buffers (ids, positions, slots, lens, tables; contiguous, as
    DecodeGraphs allocates them once, so only the step's inputs are checked), padding rows
    B..size-1."""
    ids_out, pos_out, slots_out, lens_out, tables_out = static
    batch = input_ids.shape[0]
    if not 1 <= batch <= size <= ids_out.shape[0]:
        raise ValueError(f"a batch of {batch} does not fit a graph of {size} rows "
                         f"(buffers of {ids_out.shape[0]})")
    if any(t.stride(0) != 1 for t in (input_ids, positions, slot_mapping, seq_lens)) \
            or block_tables.stride(1) != 1:
        raise ValueError("graph inputs need contiguous vectors and block-table rows")
    _graph_inputs_kernel[(size,)](
        input_ids, positions, slot_mapping, seq_lens, block_tables,
        ids_out, pos_out, slots_out, lens_out, tables_out,
        batch, block_tables.shape[1], block_tables.stride(0), tables_out.stride(0),
        tables_out.shape[1], BLOCK=BLOCK, num_warps=1)
