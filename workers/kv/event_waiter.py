"""Tell an asyncio loop when CUDA events complete: a short poll on the loop, then one
long-lived thread per waiter.

    waiter = EventWaiter()
    waiter.when_done(event, loop, callback)   # on loop: callback(None) or callback(exc)

`callback` runs on `loop` only once the event completed (event.query() was True, or
event.synchronize() returned) or with the error that query/synchronize raised, never before:
callers free or activate blocks from it. It may run inside when_done.

1. Poll: event.query() once per loop iteration (call_soon), for up to spin_seconds. A small
   copy completes within a few iterations, with no thread involved; other tasks run between
   polls. (Polling with call_later instead would sleep at least 1 ms per poll on an idle loop:
   epoll's timeout is in milliseconds.)
2. Then the waiter's thread: a queue put; the thread synchronizes and posts one
   call_soon_threadsafe. Cheaper than asyncio.to_thread per wait (a default-executor work
   item, a concurrent future wrapped in an asyncio one, a task to await it). Events reach the
   thread in the order given: CoalescedCopies records them on one stream, where they complete
   in that order, so the thread never waits behind an event that completes later than one
   queued after it.

Not taken: cudaLaunchHostFunc would run the callback on a CUDA driver thread that must take
the GIL while the copy stream stays blocked behind it (and ties this to libcudart's ABI
through ctypes).

The thread starts on the first hand-over and exits after IDLE_SECONDS without one (test
loops and unused waiters leave no threads behind); the next hand-over starts a new one. If no
thread can be started, the wait falls back to the loop's default executor.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from typing import Callable

IDLE_SECONDS = 30.0
# How long the loop polls before handing a wait to the thread: about a 700 MiB copy at NVLink
# speed, so pulls of common sizes never take the thread hop, whose latency costs streamed
# pullers of 32-64 MiB handles a tenth of the copy rate (bench/RESULTS.md, kv_transfer). The
# loop runs other callbacks between polls.
SPIN_SECONDS = 2e-3

Callback = Callable[[BaseException | None], object]


class EventWaiter:
    def __init__(self, spin_seconds: float = SPIN_SECONDS,
                 idle_seconds: float = IDLE_SECONDS) -> None:
        self._spin_seconds = spin_seconds
        self._idle_seconds = idle_seconds
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _thread against an exiting idle thread
        self._thread: threading.Thread | None = None

    def when_done(self, event, loop: asyncio.AbstractEventLoop, callback: Callback) -> None:
        """Calls callback(None | exception) on `loop` once `event` completed or its query or
        synchronize raised. Call it on the loop's thread."""
        if self._spin_seconds > 0:
            self._poll(event, loop, callback, loop.time() + self._spin_seconds)
        else:
            self._hand_over(event, loop, callback)

    def _poll(self, event, loop: asyncio.AbstractEventLoop, callback: Callback,
              deadline: float) -> None:
        try:
            complete = event.query()
        except Exception as exc:  # a CUDA error: the waiters get it
            callback(exc)
            return
        if complete:
            callback(None)
        elif loop.time() < deadline:
            loop.call_soon(self._poll, event, loop, callback, deadline)
        else:
            self._hand_over(event, loop, callback)

    def _hand_over(self, event, loop: asyncio.AbstractEventLoop, callback: Callback) -> None:
        with self._lock:  # an idle thread exits only with the queue empty, under this lock
            self._queue.put((event, loop, callback))
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="cuda-event-waiter",
                                          daemon=True)
                try:
                    thread.start()
                except RuntimeError:  # no thread to be had: take the item back, use the pool
                    self._queue.get_nowait()
                    _wait_in_executor(event, loop, callback)
                    return
                self._thread = thread

    @property
    def running(self) -> bool:
        return self._thread is not None

    def _run(self) -> None:
        while True:
            try:
                event, loop, callback = self._queue.get(timeout=self._idle_seconds)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            try:
                event.synchronize()  # releases the GIL while it waits
                error = None
            except Exception as exc:  # a CUDA error: the waiters get it
                error = exc
            try:
                loop.call_soon_threadsafe(callback, error)
            except RuntimeError:  # the loop was closed: nobody is waiting any more
                pass


def _wait_in_executor(event, loop: asyncio.AbstractEventLoop, callback: Callback) -> None:
    """The fallback: event.synchronize in the loop's default executor. Its future is never
    cancelled (nobody else holds it), so the callback always sees the wait's outcome."""
    waited = loop.run_in_executor(None, event.synchronize)
    waited.add_done_callback(lambda f: callback(f.exception()))
