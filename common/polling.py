"""The pauses between checks of something that finishes on its own (a NIXL READ, the ranks'
share of a KV transfer): none at first, then 0.1 ms doubling up to MAX_POLL_SECONDS, so a
quick transfer is seen at once and a long one costs a check every 2 ms."""
from __future__ import annotations

from collections.abc import Iterator

FIRST_POLL_SECONDS = 1e-4
MAX_POLL_SECONDS = 2e-3


def poll_delays() -> Iterator[float]:
    """0, 0.1 ms, 0.2 ms, ..., then MAX_POLL_SECONDS for ever."""
    delay = 0.0
    while True:
        yield delay
        delay = min(MAX_POLL_SECONDS, delay * 2 or FIRST_POLL_SECONDS)
