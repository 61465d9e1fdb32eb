"""A KV transfer that every rank of a TP group runs on its own heads, posted and then polled.

Both TP transfer backends (cuda-ipc copies, ipc_ranks.py; NIXL READs, nixl_ranks.py) work the
same way: rank 0 sends a post command, every rank starts its share (a copy on its copy stream,
a READ on its agent's thread) and returns at once; then rank 0 sends polls until the transfer
is done on every rank or failed on one. After a post or a poll every rank's status is
all-gathered on the control group, so every rank sees the same TransferOutcome and the group
stays in step. A poll with `finish` set ends the transfer on every rank before it answers (a
READ is cancelled, a copy is waited out): after it nothing of the transfer writes any more.

drive_on_ranks is rank 0's side, on the event loop: each post and poll is an engine command,
so the engine keeps stepping the group's other requests between polls.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

from torch.distributed import ProcessGroup

from tandem.common.polling import poll_delays
from tandem.workers.kv.transport import KVTransferFailed
from tandem.workers.parallel.control_gathers import all_gather_ints

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


def gather_outcome(status: int, group: ProcessGroup | None) -> TransferOutcome:
    """Every rank gives its status; all get the group's outcome (collective)."""
    return TransferOutcome(all_gather_ints(status, group))


async def drive_on_ranks(engine, post: Callable, poll: Callable[[bool], Callable],
                         timeout: float | None, what: str) -> None:
    """Rank 0's loop: `post` (an engine command) starts the transfer on every rank, then
    poll(finish) commands follow (paced by poll_delays: at most 2 ms apart) until it is
    settled.

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
