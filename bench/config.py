"""BenchmarkConfig: one run's settings, validated once, frozen."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tandem.bench.workload import LengthDist

__all__ = ["BenchmarkConfig"]
DEFAULT_NUM_REQUESTS = 100
WORKLOADS = ("random", "chat", "shared-prefix")


@dataclass(frozen=True)
class BenchmarkConfig:
    """Settings of one benchmark run. Times are in seconds.

    Load shape: `concurrency` (closed loop: that many requests always in flight) or `rate`
    (open loop: Poisson arrivals at that many requests/s), not both; neither means concurrency 1.
    Length: `num_requests`, `duration_s` or both (whichever ends first); neither means
    DEFAULT_NUM_REQUESTS. The first `warmup` requests are sent before those and not counted.
    Prompts are synthetic token ids (`input_len`) unless `prompts_file` (JSONL) is given.
    Lengths are LengthDist strings ("32", "uniform:16:64", "normal:128:32").
    With `http` (the router's HTTP API, http(s)://host:port) the load goes there, as streamed
    OpenAI completions, instead of to `router` over gRPC.
    `workload` (bench/prefix_workloads.py): "random" (the above), "chat" (`conversations`
    conversations of `turns` turns with `system_prompt_len`-token system prompts, each its own
    unless `shared_system_prompt` (then one for all); input_len is each user message,
    concurrency is the number of conversations; a conversation pauses `think_time_s` on
    average, exponentially distributed, between a reply and its next turn)
    or "shared-prefix" (`groups` prefixes of `prefix_len` tokens; input_len is each request's
    suffix).
    """
    router: str = "127.0.0.1:50051"
    http: str | None = None
    concurrency: int | None = None
    rate: float | None = None
    num_requests: int | None = None
    duration_s: float | None = None
    warmup: int = 0
    input_len: str = "128"
    output_len: str = "128"
    prompts_file: str | None = None
    allow_early_stop: bool = False
    temperature: float = 0.0
    seed: int = 0
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    timeout_s: float | None = None
    show_progress: bool = False
    processes: int = 1  # load-generator processes the requests are spread over
    workload: str = "random"
    conversations: int = 12
    turns: int = 6
    system_prompt_len: int = 256
    shared_system_prompt: bool = False
    groups: int = 4
    prefix_len: int = 512
    think_time_s: float = 0.0

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload: {self.workload!r} is not one of {', '.join(WORKLOADS)}")
        if self.workload != "random" and self.prompts_file is not None:
            raise ValueError(f"workload {self.workload}: its prompts are synthetic; "
                             "drop the prompts file")
        if self.workload == "chat" and self.processes > 1:
            raise ValueError("workload chat: each conversation waits for its own replies in "
                             "one process; drop --processes")
        if self.workload == "chat" and (self.rate is not None or self.concurrency is not None):
            raise ValueError("workload chat: its concurrency is --conversations; "
                             "drop --concurrency/--rate")
        _check_positive(self, "conversations", "turns", "system_prompt_len", "groups",
                        "prefix_len")
        if not self.think_time_s >= 0:
            raise ValueError(f"think_time_s: must be >= 0, not {self.think_time_s}")
        if self.concurrency is not None and self.rate is not None:
            raise ValueError("concurrency/rate: give one of them, not both")
        _check_positive(self, "concurrency", "rate", "num_requests", "duration_s",
                        "slo_ttft_s", "slo_tpot_s", "timeout_s")
        if self.processes < 1:
            raise ValueError(f"processes: must be >= 1, not {self.processes}")
        if not self.is_open_loop and self.processes > self.max_in_flight:
            raise ValueError(f"processes: {self.processes} is more than the concurrency "
                             f"{self.max_in_flight} (each process keeps a request in flight)")
        if self.warmup < 0:
            raise ValueError(f"warmup: must be >= 0, not {self.warmup}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, not {self.temperature}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed: must be in [0, 2**63), not {self.seed}")
        LengthDist.parse(self.input_len, "input_len")  # a bad length fails here, not mid-run
        LengthDist.parse(self.output_len, "output_len")

    @property
    def input_dist(self) -> LengthDist:
        return LengthDist.parse(self.input_len, "input_len")

    @property
    def output_dist(self) -> LengthDist:
        return LengthDist.parse(self.output_len, "output_len")

    @property
    def is_open_loop(self) -> bool:
        return self.rate is not None

    @property
    def max_in_flight(self) -> int | None:
        """Closed loop's request count in flight; None for open loop (unbounded)."""
        return None if self.is_open_loop else (self.concurrency or 1)

    @property
    def max_measured_requests(self) -> int | None:
        if self.num_requests is None and self.duration_s is None:
            return DEFAULT_NUM_REQUESTS
        return self.num_requests

    @property
    def target(self) -> str:
        """The address the load goes to."""
        return self.http if self.http is not None else self.router

    def load_shape(self) -> str:
        """E.g. "concurrency 4" or "Poisson 2.5 req/s"."""
        if self.workload == "chat":
            return (f"chat: {self.conversations} conversations x {self.turns} turns, "
                    f"{self.system_prompt_len}-token "
                    f"{'shared' if self.shared_system_prompt else 'per-conversation'} "
                    "system prompts")
        return f"Poisson {self.rate:g} req/s" if self.is_open_loop \
            else f"concurrency {self.max_in_flight}"

    def with_rate(self, rate: float) -> BenchmarkConfig:
        """This config in open loop at `rate` (a sweep's point)."""
        return dataclasses.replace(self, rate=rate, concurrency=None)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check_positive(config: BenchmarkConfig, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value is not None and not value > 0:
            raise ValueError(f"{name}: must be > 0, not {value}")
