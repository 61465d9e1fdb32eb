"""Reusable pinned host buffers for the block ids a gather kernel reads in place.

    buffers = PinnedBlockIds()
    ids = buffers.fill(src_ids, dst_ids)   # int32 [2, n] view: row 0 source, row 1 destination
    ... launch the kernels that read ids, record `done` after them ...
    buffers.retire(ids, done)              # reusable once `done` completed

Pinning a fresh tensor per launch costs more host time than the launch itself; filling a kept
buffer costs a few microseconds. The kernel reads the buffer over PCIe while it runs, so:

Invariant: a buffer is handed out again only after the event it was retired with has
completed (event.query() is True), i.e. after every launch that reads it finished. Buffers
that were filled but never retired (a launch raised before its event was recorded) are never
reused and never freed: they stay referenced here, so a still-queued kernel never reads
memory that the caching host allocator gave to someone else.

Retired buffers are reclaimed oldest first, stopping at the first event not yet complete: on
one stream events complete in order, so this frees everything that can be freed; with several
streams it is conservative (a buffer may wait for an earlier launch too), never unsafe.
Capacities are powers of two (MIN_PAIRS at least), so a steady stream of handles of similar
sizes reuses a handful of buffers; the pool holds at most as many buffers per capacity as
launches were in flight at once. Not thread-safe: one owner (a BlockCopier, used from one
thread) fills and retires.
"""
from __future__ import annotations

from collections import deque

import torch

MIN_PAIRS = 64  # smallest capacity in block pairs (512 bytes of ids)


class PinnedBlockIds:
    def __init__(self, pin_memory: bool = True) -> None:
        self._pin = pin_memory  # False only where there is no CUDA (CPU tests)
        self._free: dict[int, list[tuple[torch.Tensor, object]]] = {}  # capacity -> buffers
        self._lent: dict[int, tuple[int, torch.Tensor, object]] = {}  # data_ptr -> buffer
        self._retired: deque[tuple[object, int, torch.Tensor, object]] = deque()
        self.allocated = 0  # buffers ever allocated (tests, bench)

    def fill(self, src_ids: list[int], dst_ids: list[int]) -> torch.Tensor:
        """An int32 [2, n] contiguous view of a buffer holding src_ids then dst_ids; it stays
        lent (never handed out again) until retire(view, event) and that event completed."""
        n = len(src_ids)
        if n != len(dst_ids) or n == 0:
            raise ValueError(f"block ids: {n} source and {len(dst_ids)} destination blocks")
        self._reclaim()
        capacity = max(MIN_PAIRS, 1 << (n - 1).bit_length())
        free = self._free.get(capacity)
        if free:
            tensor, host = free.pop()
        else:
            tensor = torch.empty(2 * capacity, dtype=torch.int32, pin_memory=self._pin)
            host = tensor.numpy()  # the same memory, written without a torch op
            self.allocated += 1
        host[:n] = src_ids
        host[n:2 * n] = dst_ids
        self._lent[tensor.data_ptr()] = (capacity, tensor, host)
        return tensor.as_strided((2, n), (n, 1))  # the first 2n ids, contiguous

    def retire(self, ids: torch.Tensor, event) -> None:
        """ids (from fill) is read by launches queued before `event` was recorded; its buffer
        is reused once event.query() is True."""
        capacity, tensor, host = self._lent.pop(ids.data_ptr())
        self._retired.append((event, capacity, tensor, host))

    @property
    def in_flight(self) -> int:
        """Buffers lent or retired whose event has not been seen complete."""
        return len(self._lent) + len(self._retired)

    def _reclaim(self) -> None:
        retired = self._retired
        while retired and retired[0][0].query():
            _, capacity, tensor, host = retired.popleft()
            self._free.setdefault(capacity, []).append((tensor, host))
