"""EventWaiter on CPU with host events (complete once a threading.Event is set): callbacks run
on the loop only once the event completed or with its error; an event that completes while
the loop polls needs no thread; later ones are waited in order by one thread that exits when
idle and comes back on the next wait."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tandem.workers.kv.event_waiter import EventWaiter


class HostEvent:
    """synchronize() returns once `gate` is set (or raises `error`), as a CUDA event's does
    once the GPU got there."""

    def __init__(self, error: Exception | None = None) -> None:
        self.gate = threading.Event()
        self.error = error
        self.synchronized_by: threading.Thread | None = None

    def synchronize(self) -> None:
        self.gate.wait()
        self.synchronized_by = threading.current_thread()
        if self.error is not None:
            raise self.error

    def query(self) -> bool:
        if self.gate.is_set() and self.error is not None:
            raise self.error
        return self.gate.is_set()


def waiter_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "cuda-event-waiter"]


def test_callbacks_run_on_the_loop_after_synchronize_in_order():
    waiter = EventWaiter(spin_seconds=0)
    events = [HostEvent(), HostEvent(), HostEvent(RuntimeError("illegal address"))]
    seen = []

    async def run():
        loop = asyncio.get_running_loop()
        all_done = loop.create_future()

        def callback(index, error):
            assert threading.current_thread() is threading.main_thread()
            assert events[index].synchronized_by is not None  # synchronize had returned
            seen.append((index, None if error is None else str(error)))
            if len(seen) == len(events) and not all_done.done():
                all_done.set_result(None)

        for index, event in enumerate(events):
            waiter.when_done(event, loop, lambda error, index=index: callback(index, error))
        await asyncio.sleep(0.05)
        assert seen == []  # nothing before the GPU got there
        for event in reversed(events):  # the last event's gate opens first: still in order
            event.gate.set()
        await asyncio.wait_for(all_done, 5)

    asyncio.run(run())
    assert seen == [(0, None), (1, None), (2, "illegal address")]
    assert {e.synchronized_by.name for e in events} == {"cuda-event-waiter"}


@pytest.mark.parametrize("error", [None, RuntimeError("misaligned address")])
def test_an_event_completing_while_polled_needs_no_thread(error):
    waiter = EventWaiter(spin_seconds=5.0)
    event = HostEvent(error)

    async def run():
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        waiter.when_done(event, loop, done.set_result)
        for _ in range(20):  # other work runs between polls
            await asyncio.sleep(0)
        assert not done.done()
        loop.call_later(0.01, event.gate.set)  # the 'GPU' finishes while the loop polls
        return await asyncio.wait_for(done, 5)

    assert asyncio.run(run()) is error
    assert not waiter.running and event.synchronized_by is None


def test_an_event_outlasting_the_poll_goes_to_the_thread():
    waiter = EventWaiter(spin_seconds=0.01)
    event = HostEvent()

    async def run():
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        waiter.when_done(event, loop, done.set_result)
        await asyncio.sleep(0.1)
        assert waiter.running and not done.done()
        event.gate.set()
        return await asyncio.wait_for(done, 5)

    assert asyncio.run(run()) is None
    assert event.synchronized_by.name == "cuda-event-waiter"


def test_one_thread_serves_every_wait_and_leaves_when_idle():
    waiter = EventWaiter(spin_seconds=0, idle_seconds=0.2)
    before = len(waiter_threads())

    async def wait_all(count):
        loop = asyncio.get_running_loop()
        futures = []
        for _ in range(count):
            event, done = HostEvent(), loop.create_future()
            event.gate.set()
            waiter.when_done(event, loop, done.set_result)
            futures.append(done)
        assert len(waiter_threads()) == before + 1
        assert await asyncio.gather(*futures) == [None] * count

    asyncio.run(wait_all(20))
    deadline = time.monotonic() + 5
    while waiter.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not waiter.running and len(waiter_threads()) == before
    asyncio.run(wait_all(3))  # a new loop, a new thread


def test_a_wait_whose_loop_closed_does_not_stop_the_thread():
    waiter = EventWaiter(spin_seconds=0)
    orphan = HostEvent()

    async def leave_one_behind():
        waiter.when_done(orphan, asyncio.get_running_loop(), lambda error: None)

    asyncio.run(leave_one_behind())  # the loop closes before the event completes
    orphan.gate.set()

    async def wait_one():
        loop = asyncio.get_running_loop()
        event, done = HostEvent(), loop.create_future()
        event.gate.set()
        waiter.when_done(event, loop, done.set_result)
        await asyncio.wait_for(done, 5)

    asyncio.run(wait_one())
    assert waiter.running


@pytest.mark.parametrize("error", [None, ValueError("cuda error")])
def test_the_executor_fallback_keeps_the_same_contract(monkeypatch, error):
    waiter = EventWaiter(spin_seconds=0)

    start = threading.Thread.start

    def refuse_the_waiter(thread):  # the executor's own threads still start
        if thread.name == "cuda-event-waiter":
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refuse_the_waiter)
    event = HostEvent(error)

    async def run():
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        waiter.when_done(event, loop, done.set_result)
        await asyncio.sleep(0.05)
        assert not done.done()
        event.gate.set()
        return await asyncio.wait_for(done, 5)

    result = asyncio.run(run())
    assert (result is None) if error is None else (result is error)
    assert not waiter.running and event.synchronized_by.name != "cuda-event-waiter"
