"""StallWatchdog: the stall timeout of a worker stream's reads, against a real gRPC stream."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from helpers.standin_server import serve

from tandem.router.request_flow import StallWatchdog
from tandem.v1 import worker_pb2, worker_pb2_grpc


class PacedDecode(worker_pb2_grpc.WorkerServicer):
    """Decode streams one token after each delay in `gaps` (seconds), then finishes."""

    def __init__(self, gaps: list[float]) -> None:
        self.gaps = gaps

    async def Decode(self, request, context):  # noqa: N802 (gRPC's naming)
        for index, gap in enumerate(self.gaps):
            await asyncio.sleep(gap)
            yield worker_pb2.DecodeResponse(token_ids=[index])


def read_all(gaps: list[float], seconds: float, pause_between_reads: float = 0.0,
             later_seconds: float | None = None):
    """The token ids read through a watchdog of `seconds` (`later_seconds` after the first
    message, when given), and "timeout" if it timed out."""
    with serve(lambda server: worker_pb2_grpc.add_WorkerServicer_to_server(
            PacedDecode(gaps), server)) as address:
        async def main():
            async with grpc.aio.insecure_channel(address) as channel:
                call = worker_pb2_grpc.WorkerStub(channel).Decode(worker_pb2.DecodeRequest())
                watchdog = StallWatchdog(seconds)
                token_ids = []
                try:
                    while (message := await watchdog.read(call)) is not grpc.aio.EOF:
                        token_ids += message.token_ids
                        if later_seconds is not None:
                            watchdog.seconds = later_seconds
                        await asyncio.sleep(pause_between_reads)
                except asyncio.TimeoutError:
                    assert asyncio.current_task().cancelling() == 0, "left cancelled"
                    return token_ids, "timeout"
                finally:
                    watchdog.close()
                    call.cancel()
                return token_ids, None
        return asyncio.run(main())


def test_a_gap_longer_than_the_limit_times_out_the_read():
    assert read_all([0.0, 0.0, 1.5], seconds=0.3) == ([0, 1], "timeout")


def test_a_shorter_limit_after_the_first_message_applies_at_once():
    """The first message gets the generous first-token allowance; the next gap is held to the
    token-gap limit, not to the allowance's timer."""
    assert read_all([0.0, 2.0], seconds=30.0, later_seconds=0.3) == ([0], "timeout")


def test_gaps_within_the_limit_pass_however_long_the_stream():
    assert read_all([0.1] * 8, seconds=0.3) == (list(range(8)), None)


def test_time_between_reads_does_not_count():
    """The relay spends time handing a chunk to the client between reads: not a stall."""
    assert read_all([0.0, 0.0, 0.0], seconds=0.2, pause_between_reads=0.5) == ([0, 1, 2], None)


def test_no_limit_never_times_out():
    assert read_all([0.0, 0.4], seconds=None) == ([0, 1], None)


def test_a_cancel_from_outside_stays_a_cancel():
    with serve(lambda server: worker_pb2_grpc.add_WorkerServicer_to_server(
            PacedDecode([5.0]), server)) as address:
        async def main():
            async with grpc.aio.insecure_channel(address) as channel:
                call = worker_pb2_grpc.WorkerStub(channel).Decode(worker_pb2.DecodeRequest())

                async def read():
                    watchdog = StallWatchdog(10.0)
                    try:
                        return await watchdog.read(call)
                    finally:
                        watchdog.close()
                task = asyncio.create_task(read())
                await asyncio.sleep(0.2)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
        asyncio.run(main())
