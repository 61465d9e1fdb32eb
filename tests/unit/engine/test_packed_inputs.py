"""A step's packed inputs (engine/packed_inputs.py): the header a decode CUDA graph reads on the
device names where each part lies, for the leader's buffer (ModelRunner.prepare_inputs) and a
TP follower's (step_inputs.unpack_inputs), at a prefill and at a decode step."""
from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.workers.engine.packed_inputs import (INPUT_HEADER, TABLE_WIDTH_MULTIPLE,
                                                 max_packed_size)
from tandem.workers.executor.step_inputs import pack_inputs, unpack_inputs


@pytest.fixture(scope="module")
def engine(checkpoint):
    return LLM(checkpoint("llama").path, dtype="float32", max_num_seqs=4, num_kv_blocks=64,
               async_scheduling=False).engine


def header_parts(packed: torch.Tensor) -> dict[str, torch.Tensor]:
    """The parts the header points at, as the graph's copy kernel finds them."""
    batch, width, ids_at, pos_at, slots_at, lens_at, tables_at, zero = packed[:INPUT_HEADER]
    assert zero == 0
    return {"ids": packed[ids_at:ids_at + batch], "positions": packed[pos_at:pos_at + batch],
            "slots": packed[slots_at:slots_at + batch], "lens": packed[lens_at:lens_at + batch],
            "tables": packed[tables_at:tables_at + batch * width].view(int(batch), int(width))}


def expected_parts(inputs) -> dict[str, torch.Tensor]:
    meta = inputs.meta
    return {"ids": inputs.input_ids, "positions": inputs.positions, "slots": meta.slot_mapping,
            "lens": meta.seq_lens.long(), "tables": meta.block_tables.long()}


@pytest.mark.parametrize("decode", [False, True])
def test_the_header_names_every_part_for_leader_and_follower(engine, decode):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = [f"{decode}-{i}" for i in range(3)]
    for request_id, length in zip(ids, (5, 40, 23)):
        engine.add_request(list(range(3, 3 + length)), params, request_id)
    try:
        if decode:
            engine.step()  # the prompts, all in one step
        batch = engine.scheduler.schedule()
        inputs = engine.runner.prepare_inputs(batch)
        assert (inputs.meta.max_query_len == 1) == decode
        packed = inputs.packed
        assert int(packed[0]) == len(batch.scheduled) == 3
        assert int(packed[1]) % TABLE_WIDTH_MULTIPLE == 0
        assert all(int(at) % 2 == 0 for at in packed[2:7])  # 16-byte aligned parts
        if decode:  # within what a decode graph's staging buffer holds for this batch
            longest = max(len(item.seq.block_table) for item in batch.scheduled)
            assert packed.numel() <= max_packed_size(3, longest)
            assert max_packed_size(3, longest) == packed.numel()  # tight for an odd batch
        follower = unpack_inputs(*pack_inputs(inputs), torch.device("cpu"))
        for source in (packed, follower.packed):
            got, want = header_parts(source), expected_parts(inputs)
            # At a decode step each row has one token, so the rows a graph reads are the
            # step's ids, positions and slots; at a prefill only lengths and tables are rows.
            for name in ("ids", "positions", "slots", "lens", "tables")[0 if decode else 3:]:
                assert torch.equal(got[name], want[name]), name
    finally:
        for request_id in ids:
            engine.abort(request_id)
