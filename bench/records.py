"""RequestRecord: what the load generator saw of one request, and its per-request latencies.

Times are time.perf_counter() seconds. Only chunks that carry token ids are recorded (a chunk
may carry several tokens when the router batches output for a slow reader). Token arrival times
are derived from them: the first chunk's tokens all arrive at that chunk's arrival; a later
chunk's k tokens are spread evenly over the gap since the previous chunk, the last of them at
the chunk's own arrival. So the first and last token times are real arrivals (TTFT, TPOT and e2e
never depend on the spreading), and a request's inter-token latencies sum to last - first.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RequestRecord"]


@dataclass(slots=True)
class RequestRecord:
    """One request. `error_code` is a grpc.StatusCode name (or INCOMPLETE_STREAM when the stream
    ended without its Complete message); None on success."""
    index: int
    start_s: float
    end_s: float | None = None
    is_warmup: bool = False
    max_tokens: int = 0
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_num_tokens: list[int] = field(default_factory=list)
    num_prompt_tokens: int | None = None
    finish_reason: str | None = None
    error_code: str | None = None
    error_message: str = ""
    router_timings: dict[str, float] = field(default_factory=dict)
    num_cached_prompt_tokens: int | None = None  # served from the worker's prefix cache
    ideal_cached_tokens: int | None = None  # what one worker with enough cache would reuse

    def add_chunk(self, arrival_s: float, num_tokens: int) -> None:
        if num_tokens > 0:
            self.chunk_times_s.append(arrival_s)
            self.chunk_num_tokens.append(num_tokens)

    @property
    def is_ok(self) -> bool:
        return self.error_code is None and self.end_s is not None

    @property
    def num_output_tokens(self) -> int:
        return sum(self.chunk_num_tokens)

    def token_times_s(self) -> list[float]:
        """One arrival time per output token (see the module docstring for multi-token chunks)."""
        times: list[float] = []
        previous = None
        for arrival, num_tokens in zip(self.chunk_times_s, self.chunk_num_tokens):
            if previous is None:
                times += [arrival] * num_tokens
            else:
                step = (arrival - previous) / num_tokens
                times += [previous + step * j for j in range(1, num_tokens)] + [arrival]
            previous = arrival
        return times

    @property
    def ttft_s(self) -> float | None:
        """Send to first token; None without tokens."""
        return self.chunk_times_s[0] - self.start_s if self.chunk_times_s else None

    @property
    def tpot_s(self) -> float | None:
        """(last token - first token) / (num_output_tokens - 1); None below two tokens."""
        num_tokens = self.num_output_tokens
        if num_tokens < 2:
            return None
        return (self.chunk_times_s[-1] - self.chunk_times_s[0]) / (num_tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.start_s

    def itls_s(self) -> list[float]:
        """The num_output_tokens - 1 gaps between consecutive token arrivals."""
        times = self.token_times_s()
        return [b - a for a, b in zip(times, times[1:])]

    def summary(self, origin_s: float) -> dict:
        """A JSON-ready digest; times relative to `origin_s` (the run's start)."""
        return {
            "index": self.index, "is_warmup": self.is_warmup, "ok": self.is_ok,
            "error_code": self.error_code, "error_message": self.error_message or None,
            "finish_reason": self.finish_reason, "max_tokens": self.max_tokens,
            "prompt_tokens": self.num_prompt_tokens, "output_tokens": self.num_output_tokens,
            "num_chunks": len(self.chunk_times_s), "start_s": self.start_s - origin_s,
            "ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "e2e_s": self.e2e_s,
            "cached_prompt_tokens": self.num_cached_prompt_tokens,
            "ideal_cached_tokens": self.ideal_cached_tokens,
            "router_queue_s": self.router_timings.get("queue_seconds"),
            "router_ttft_s": self.router_timings.get("time_to_first_token_seconds"),
        }
