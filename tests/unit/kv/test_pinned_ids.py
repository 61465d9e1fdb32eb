"""PinnedBlockIds' reuse rule on CPU (unpinned buffers, host events whose completion the test
decides): a buffer is handed out again only after the event it was retired with completed, and
until then it keeps the ids a kernel may still be reading. tests/gpu/test_block_copy_gpu.py
runs it pinned under back-to-back gathers."""
from __future__ import annotations

import pytest
import torch

from tandem.workers.kv.pinned_ids import MIN_PAIRS, PinnedBlockIds


class HostEvent:
    """A CUDA event's query() as far as the pool uses it: complete once the test says so."""

    def __init__(self, complete: bool = False) -> None:
        self.complete = complete

    def query(self) -> bool:
        return self.complete


def test_fill_lays_out_source_row_then_destination_row():
    ids = PinnedBlockIds(pin_memory=False).fill([5, 0, 9], [1, 2, 3])
    assert ids.dtype == torch.int32 and ids.is_contiguous()
    assert ids.tolist() == [[5, 0, 9], [1, 2, 3]]
    # the kernel reads row 1 at ids_ptr + n: the rows are adjacent in memory
    assert ids[1].data_ptr() == ids.data_ptr() + 3 * 4


def test_a_buffer_is_reused_only_after_its_event_completed():
    pool = PinnedBlockIds(pin_memory=False)
    first = pool.fill([1, 2], [3, 4])
    pending = HostEvent()
    pool.retire(first, pending)
    second = pool.fill([7], [8])  # the first launch may still read its buffer
    assert second.data_ptr() != first.data_ptr()
    assert first.tolist() == [[1, 2], [3, 4]]  # untouched while its kernel may run
    pool.retire(second, HostEvent(complete=True))
    pending.complete = True
    reused = {pool.fill([i], [i]).data_ptr() for i in range(2)}
    assert reused == {first.data_ptr(), second.data_ptr()}
    assert pool.allocated == 2


def test_reclaim_goes_oldest_first_and_stops_at_a_pending_event():
    pool = PinnedBlockIds(pin_memory=False)
    older, newer = pool.fill([0], [0]), pool.fill([1], [1])
    older_done, newer_done = HostEvent(), HostEvent(complete=True)
    pool.retire(older, older_done)
    pool.retire(newer, newer_done)
    assert pool.fill([2], [2]).data_ptr() not in (older.data_ptr(), newer.data_ptr())
    assert pool.allocated == 3
    older_done.complete = True  # now both are free (one stream: the newer completed too)
    assert {pool.fill([3], [3]).data_ptr(), pool.fill([4], [4]).data_ptr()} == {
        older.data_ptr(), newer.data_ptr()}


def test_a_buffer_never_retired_is_never_handed_out_again():
    pool = PinnedBlockIds(pin_memory=False)
    kept = pool.fill([1], [2])  # its launch raised before an event was recorded
    for i in range(5):
        ids = pool.fill([i], [i])
        assert ids.data_ptr() != kept.data_ptr()
        pool.retire(ids, HostEvent(complete=True))
    assert kept.tolist() == [[1], [2]]
    assert pool.allocated == 2  # the kept buffer and one reused by every other fill


def test_capacities_are_power_of_two_buckets():
    pool = PinnedBlockIds(pin_memory=False)
    small = pool.fill([0], [1])
    pool.retire(small, HostEvent(complete=True))
    n = MIN_PAIRS
    full = pool.fill(list(range(n)), list(range(n, 2 * n)))
    assert full.data_ptr() == small.data_ptr()  # 1 and MIN_PAIRS pairs share a bucket
    pool.retire(full, HostEvent(complete=True))
    big = pool.fill(list(range(n + 1)), list(range(n + 1, 2 * n + 2)))
    assert big.data_ptr() != small.data_ptr() and pool.allocated == 2
    assert big.flatten().tolist() == list(range(2 * n + 2))


def test_mismatched_or_empty_ids_are_refused():
    pool = PinnedBlockIds(pin_memory=False)
    with pytest.raises(ValueError, match="2 source and 1 destination"):
        pool.fill([0, 1], [2])
    with pytest.raises(ValueError):
        pool.fill([], [])
    assert pool.in_flight == 0
