"""Batches the decode side's cuda-ipc copies: every copy requested in one event-loop turn from
the same peer is launched as one gather (one id upload, one kernel), then awaited together in
a thread, so a burst of handoffs costs one launch instead of one per handle.

    copies = CoalescedCopies(stream)
    await copies.copy(copier, src_ids, dst_ids)   # copier: cuda_ipc.BlockCopier of the peer

Invariant: `copy` returns (or raises, or propagates a cancellation) only once the GPU has
finished writing dst_ids, so a caller never frees or activates blocks a copy still writes.
"""
from __future__ import annotations

import asyncio

from tandem.workers.kv.cuda_ipc import check_block_pairs


class CoalescedCopies:
    def __init__(self, stream) -> None:
        self._stream = stream
        self._pending: dict[int, tuple[object, list]] = {}  # id(copier) -> (copier, requests)
        self._waits: set[asyncio.Task] = set()  # the loop keeps only weak task references

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
        pending, self._pending = self._pending, {}
        for copier, requests in pending.values():
            futures = [done for _, _, done in requests]
            try:
                event = copier.launch([i for src, _, _ in requests for i in src],
                                      [i for _, dst, _ in requests for i in dst], self._stream)
            except Exception as exc:  # nothing was queued: every requester gets the error
                _finish(futures, exc)
                continue
            task = asyncio.ensure_future(self._wait(event, futures))
            self._waits.add(task)
            task.add_done_callback(self._waits.discard)

    @staticmethod
    async def _wait(event, futures) -> None:
        try:
            await asyncio.to_thread(event.synchronize)
        except Exception as exc:
            _finish(futures, exc)
            return
        _finish(futures, None)


def _finish(futures: list[asyncio.Future], exc: BaseException | None) -> None:
    for done in futures:
        if not done.done():
            if exc is None:
                done.set_result(None)
            else:
                done.set_exception(exc)
