"""A decode step's inputs into the static buffers its CUDA graph reads, inside the graph.

engine/cuda_graphs.DecodeGraphs replays a graph captured over fixed buffers (token ids,
positions, KV slots, sequence lengths, block tables); each step's values must reach them first,
and a batch smaller than its graph pads the rows past it. A step's inputs arrive as one int64
device buffer (ModelInputs.packed, engine/model_runner.py), which starts with a header saying
where each part is (engine/packed_inputs.py):

    [batch, table width, ids at, positions at, slots at, lengths at, tables at, 0]

DecodeGraphs copies that buffer whole into a staging buffer of its own (one device-to-device
copy, a few microseconds of host time) and replays; the graph's first kernel, this one, reads
the header and fills the static buffers, one program per row of the graph:

    row < batch   ids, position, slot, length and the first `width` table entries copied
    row >= batch  padding: id 0, position 0, slot -1 (the KV write skips it), length 1, and a
                  table row of zeros (it reads block 0 and its output is dropped)

Rows at or past the graph's size and a real row's table entries past `width` are left as they
are: no kernel reads a table entry past its sequence's blocks. Launched from Python per step,
the copy would cost a kernel launch's host time (tens of microseconds for a Triton launch) in
which the idle GPU waits for the replay; captured, it costs only its run on the device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.workers.engine.packed_inputs import INPUT_HEADER

BLOCK = 256  # table entries per step of a program's loop


@triton.jit
def _graph_inputs_kernel(staged_ptr, ids_out, pos_out, slots_out, lens_out, tables_out,
                         out_stride, out_width, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    batch = tl.load(staged_ptr)
    width = tl.load(staged_ptr + 1)
    real = row < batch  # a padding row reads nothing
    src = staged_ptr + row
    tl.store(ids_out + row, tl.load(src + tl.load(staged_ptr + 2), mask=real, other=0))
    tl.store(pos_out + row, tl.load(src + tl.load(staged_ptr + 3), mask=real, other=0))
    tl.store(slots_out + row, tl.load(src + tl.load(staged_ptr + 4), mask=real, other=-1))
    tl.store(lens_out + row,
             tl.load(src + tl.load(staged_ptr + 5), mask=real, other=1).to(tl.int32))
    copied = tl.where(real, tl.minimum(width, out_width), 0)  # entries read from the batch
    entries = tl.where(real, copied, out_width)  # entries written
    table = staged_ptr + tl.load(staged_ptr + 6) + row * width
    dst = tables_out + row.to(tl.int64) * out_stride
    for start in range(0, entries, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        tl.store(dst + cols, tl.load(table + cols, mask=cols < copied, other=0).to(tl.int32),
                 mask=cols < entries)


def unpack_graph_inputs(staged: torch.Tensor, static: tuple[torch.Tensor, ...],
                        size: int) -> None:
    """Rows 0..size-1 of the graph's static buffers (ids, positions, slots [R] int64, lens [R]
    int32, tables [R, W] int32; contiguous, as DecodeGraphs allocates them once) from a packed
    step in `staged` (int64, INPUT_HEADER entries first), its batch at most `size`: the batch's rows
    copied, the rest padding. Reads the batch and its layout on the device, so a CUDA graph
    captures the launch once for every step."""
    ids_out, pos_out, slots_out, lens_out, tables_out = static
    if not 1 <= size <= ids_out.shape[0] or staged.dtype != torch.int64 \
            or staged.numel() < INPUT_HEADER or staged.stride(0) != 1:
        raise ValueError(f"graph inputs: {size} rows of buffers of {ids_out.shape[0]} from a "
                         f"contiguous int64 staging buffer of at least {INPUT_HEADER} "
                         "entries")
    _graph_inputs_kernel[(size,)](
        staged, ids_out, pos_out, slots_out, lens_out, tables_out, tables_out.stride(0),
        tables_out.shape[1], BLOCK=BLOCK, num_warps=1)
