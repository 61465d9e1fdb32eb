"""A KV transfer that every rank of a TP group runs on its own heads, started and then polled.

Every rank-side backend (rank_connector.py: cuda-ipc copies, NIXL READs, ...) works the same
way: rank 0 sends a Load op, every rank starts its share (a copy on its copy stream, a READ on
its agent's thread) and returns at once; then rank 0 sends Poll ops until the transfer is done
on every rank or failed on one. After each, every rank's status is all-gathered on the control
group (rank_ops.py), so every rank sees the same TransferOutcome and the group stays in step.
A poll with `finish` set ends the transfer on every rank before it answers (a READ is
cancelled, a copy is waited out): after it nothing of the transfer writes any more.

drive_on_ranks is rank 0's side, on the event loop: each load and poll runs on the engine
thread as a step of KV ops, so the engine keeps stepping the group's other requests between
polls.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

from tandem.common.polling import poll_delays
from tandem.workers.kv.transport import KVTransferFailed

PENDING, DONE, FAILED = 0, 1, 2  # one rank's state of a posted transfer


@dataclasses.dataclass(frozen=True)
class TransferOutcome:
    """A posted transfer as the whole group sees it: every rank's status, in rank order."""
    statuses: list[int]

    @property
    def failed(self) -> list[int]:
        return [rank for rank, status in enumerate(self.statuses) if status == FAILED]

    @property
    def done(self) -> bool:
        return all(status == DONE for status in self.statuses)

    @property
    def settled(self) -> bool:
        return self.done or bool(self.failed)


async def drive_on_ranks(engine, post, poll: Callable[[bool], object],
                         timeout: float | None, what: str) -> None:
    """Rank 0's loop: `post` starts the transfer on every rank, then poll(finish) follows
    (paced by poll_delays: at most 2 ms apart) until it is settled. `engine` runs them on the
    engine thread: `await engine.call(x)` answers a TransferOutcome, `engine.submit(x)` queues
    x without waiting (rank_group.RankGroupKV: x is a KV rank op).

    Raises KVTransferFailed naming the failed ranks, or, once `timeout` seconds passed, after
    a finishing poll. If the caller is cancelled, a finishing poll is queued (engine commands
    run in the order queued, so it runs before anything the caller's clean-up queues after,
    such as freeing the request's blocks)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    settled = False
    try:
        outcome = await engine.call(post)
        delays = poll_delays()
        while not outcome.settled:
            late = deadline is not None and time.monotonic() > deadline
            if not late:
                await asyncio.sleep(next(delays))
            outcome = await engine.call(poll(late))
            if late and not outcome.done:
                settled = True
                raise KVTransferFailed(f"{what} not done on every rank after {timeout:.1f} s")
        settled = True
    finally:
        if not settled:  # cancelled: end it on every rank before any block is freed
            engine.submit(poll(True))
    if outcome.failed:
        raise KVTransferFailed(f"{what} failed on rank(s) {outcome.failed} (see their logs)")
