"""Batches the decode side's cuda-ipc copies: every copy requested in one event-loop turn from
the same peer is launched as one gather (one id buffer, one kernel), then awaited together, so
a burst of handoffs costs one launch instead of one per handle.

    copies = CoalescedCopies(stream)
    await copies.copy(copier, src_ids, dst_ids)   # copier: cuda_ipc.BlockCopier of the peer

Invariant: `copy` returns (or raises, or propagates a cancellation) only once the GPU has
finished writing dst_ids, so a caller never frees or activates blocks a copy still writes.
Its future is settled only by the launch raising (BlockCopier.launch raises with nothing of it
still running) or by the EventWaiter once the launch's event completed (event_waiter.py: a
short poll on the loop, then one long-lived thread instead of a thread-pool hop per wait; the
launches of one CoalescedCopies share its stream, so their events complete in launch order).
"""
from __future__ import annotations

import asyncio
import functools

from tandem.workers.kv.cuda_ipc import check_block_pairs
from tandem.workers.kv.event_waiter import EventWaiter


class CoalescedCopies:
    def __init__(self, stream, waiter: EventWaiter | None = None) -> None:
        self._stream = stream
        self._pending: dict[int, tuple[object, list]] = {}  # id(copier) -> (copier, requests)
        self._waiter = waiter or EventWaiter()

    async def copy(self, copier, src_ids: list[int], dst_ids: list[int]) -> None:
        check_block_pairs(src_ids, dst_ids)  # here, so a bad request fails alone
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.setdefault(id(copier), (copier, []))[1].append((src_ids, dst_ids, done))
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            if not done.done():
                await asyncio.wait({done})  # the blocks are being written: hold them till then
            raise

    def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        pending, self._pending = self._pending, {}
        for copier, requests in pending.values():
            futures = [done for _, _, done in requests]
            try:
                event = copier.launch([i for src, _, _ in requests for i in src],
                                      [i for _, dst, _ in requests for i in dst], self._stream)
            except Exception as exc:  # nothing of it is running: every requester gets the error
                _finish(futures, exc)
                continue
            self._waiter.when_done(event, loop, functools.partial(_finish, futures))


def _finish(futures: list[asyncio.Future], exc: BaseException | None) -> None:
    for done in futures:
        if not done.done():
            if exc is None:
                done.set_result(None)
            else:
                done.set_exception(exc)
