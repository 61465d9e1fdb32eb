"""drive_on_ranks (workers/kv/rank_transfers.py), the loop both TP transfer backends use
on rank 0, on a real AsyncEngine stepping a real tiny model: it polls until every rank is done,
names the ranks that failed, ends a transfer that outlived its timeout with a finishing poll,
and when its caller is cancelled queues a finishing poll that runs before any command queued
after it (so the request's blocks are never freed while a rank may still write them).

The ranks' side is a transfer scripted per poll (statuses in rank order); the real ranks' side
of each backend is tested in test_ipc_ranks.py, test_nixl_ranks.py and tests/gpu."""
from __future__ import annotations

import asyncio

import pytest

from tandem import LLM
from tandem.workers.async_engine import AsyncEngine
from tandem.workers.kv.transport import KVTransferFailed
from tandem.workers.kv.rank_transfers import (DONE, FAILED, PENDING, TransferOutcome,
                                                    drive_on_ranks)


class ScriptedTransfer:
    """A transfer whose k-th answer is script[k] (the last repeats); records every command
    as ('post' | 'poll' | 'finish', engine thread's view) in the order the engine ran them."""

    def __init__(self, script: list[list[int]]) -> None:
        self.script = script
        self.calls: list[str] = []

    def _answer(self, kind: str) -> TransferOutcome:
        statuses = self.script[min(len(self.calls), len(self.script) - 1)]
        self.calls.append(kind)
        return TransferOutcome(list(statuses))

    def post(self, engine) -> TransferOutcome:
        return self._answer("post")

    def poll(self, finish: bool):
        return lambda engine: self._answer("finish" if finish else "poll")


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint("llama").path, dtype="float32")


def drive(llm, body):
    async def main():
        engine = AsyncEngine(llm.engine)
        engine.start()
        try:
            return await body(engine)
        finally:
            await engine.stop()
    return asyncio.run(main())


def test_polls_until_every_rank_is_done(llm):
    transfer = ScriptedTransfer([[DONE, PENDING], [PENDING, PENDING], [DONE, PENDING],
                                 [DONE, DONE]])
    drive(llm, lambda engine: drive_on_ranks(engine, transfer.post, transfer.poll, 5.0, "copy"))
    assert transfer.calls == ["post", "poll", "poll", "poll"]


def test_a_failed_rank_is_named(llm):
    transfer = ScriptedTransfer([[PENDING, PENDING], [DONE, FAILED]])
    with pytest.raises(KVTransferFailed, match=r"copy of 3 blocks failed on rank\(s\) \[1\]"):
        drive(llm, lambda engine: drive_on_ranks(engine, transfer.post, transfer.poll, 5.0,
                                                 "copy of 3 blocks"))
    assert transfer.calls == ["post", "poll"]


def test_a_transfer_past_its_timeout_is_finished_and_fails(llm):
    transfer = ScriptedTransfer([[PENDING, PENDING]])
    with pytest.raises(KVTransferFailed, match="READ not done on every rank after 0.1 s"):
        drive(llm, lambda engine: drive_on_ranks(engine, transfer.post, transfer.poll, 0.1,
                                                 "READ"))
    assert transfer.calls[0] == "post" and transfer.calls[-1] == "finish"
    assert transfer.calls.count("finish") == 1 and len(transfer.calls) > 3


def test_a_cancelled_caller_finishes_the_transfer_before_later_commands(llm):
    transfer = ScriptedTransfer([[PENDING, PENDING]])

    async def body(engine):
        task = asyncio.create_task(drive_on_ranks(engine, transfer.post, transfer.poll, None,
                                                  "copy"))
        while transfer.calls.count("poll") < 2:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # What a cancelled pull's clean-up queues next (freeing the request's blocks).
        await engine.call(lambda e: transfer.calls.append("free blocks"))

    drive(llm, body)
    assert transfer.calls[-2:] == ["finish", "free blocks"]
    assert transfer.calls.count("finish") == 1
