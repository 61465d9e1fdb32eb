"""How a step's inputs lie in the one int64 buffer that carries them to the device.

ModelRunner.prepare_inputs (and, under TP, a follower rank's step_inputs.unpack_inputs) puts
every part of a step's inputs in one buffer, sent in one copy, after a header that says where
the parts are, so that a decode CUDA graph's first kernel can find them on the device
(ops/gpu/graph_inputs.py) whatever the batch:

    [batch, table width, ids at, positions at, slots at, lengths at, tables at, 0]

(offsets in int64 entries from the buffer's start; tables are `batch` rows of `table width`).
Pure Python: CPU installs import it.
"""
from __future__ import annotations

INPUT_HEADER = 8  # int64 entries before a packed step's parts

# Block tables are padded (block id 0, never read: seq_lens bound every kernel's reads) to a
# multiple of this width. Triton specializes integer arguments on divisibility by 16, so an
# unpadded table's row stride would compile every attention kernel twice (a table of 16k
# blocks and one of any other width), the second time while serving.
TABLE_WIDTH_MULTIPLE = 16


def table_width(max_blocks: int) -> int:
    """The padded block-table width of a step whose longest table has max_blocks blocks."""
    return -(-max_blocks // TABLE_WIDTH_MULTIPLE) * TABLE_WIDTH_MULTIPLE


def max_packed_size(num_seqs: int, table_blocks: int) -> int:
    """The most int64 entries a packed decode step of num_seqs sequences (a token each) takes
    when its longest block table has table_blocks blocks: the header, six parts of num_seqs
    entries (the sequence starts num_seqs + 1), each padded to an even count
    (ModelRunner.prepare_inputs), so 6 (num_seqs + 1) at most, and the padded tables."""
    return INPUT_HEADER + 6 * (num_seqs + 1) + num_seqs * table_width(table_blocks)


def input_header(num_seqs: int, width: int, part_starts: list[int]) -> list[int]:
    """The INPUT_HEADER entries at the start of a packed step whose seven parts (ids,
    positions, slots, query starts, lengths, tables, logits indices; the order both packers
    use) start at part_starts; the decode graphs read all but the query starts and logits
    indices."""
    ids_at, positions_at, slots_at, _, lens_at, tables_at, _ = part_starts
    return [num_seqs, width, ids_at, positions_at, slots_at, lens_at, tables_at, 0]
