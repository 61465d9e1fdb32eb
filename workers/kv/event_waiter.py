"""Tell an asyncio loop when CUDA events complete, from one long-lived thread per waiter.

    waiter = EventWaiter()
    waiter.when_done(event, loop, callback)   # later, on loop: callback(None) or callback(exc)

`callback` runs on `loop` only after event.synchronize() returned (None) or raised (the
exception), never before: callers free or activate blocks from it.

Why a thread of its own rather than asyncio.to_thread(event.synchronize) per wait: to_thread
goes through the default executor (a work item, a concurrent future wrapped in an asyncio
future, a task to await it), some tens of microseconds of Python per wait; here a wait is one
queue put, and the thread posts one call_soon_threadsafe. Events are waited in the order
given: CoalescedCopies records them on one stream, where they complete in that order, so a
single thread never waits behind an event that completes later than the one it waits for.

Alternatives not taken: cudaLaunchHostFunc would run the callback on a CUDA driver thread
that must take the GIL while the copy stream stays blocked behind it (and ties this module to
libcudart's ABI through ctypes); polling event.query() from the loop with call_later sleeps
at least 1 ms per poll when the loop is idle (epoll's timeout is in milliseconds).

The thread starts on the first wait and exits after IDLE_SECONDS without one (so test loops
and unused waiters leave no threads behind); the next wait starts a new one. If no thread can
be started, the wait falls back to the loop's default executor.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from typing import Callable

IDLE_SECONDS = 30.0

Callback = Callable[[BaseException | None], object]


class EventWaiter:
    def __init__(self, idle_seconds: float = IDLE_SECONDS) -> None:
        self._idle_seconds = idle_seconds
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _thread against an exiting idle thread
        self._thread: threading.Thread | None = None

    def when_done(self, event, loop: asyncio.AbstractEventLoop, callback: Callback) -> None:
        """Calls callback(None | exception) on `loop` once event.synchronize() returned or
        raised. Call it on the loop's thread (the fallback uses loop.run_in_executor)."""
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
