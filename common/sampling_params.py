"""Per-request sampling and stop settings, shared by the offline API, the router and the workers."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.common.structured_output import StructuredOutput

# Top-N logprobs a request may ask for; more would make every step's output large.
MAX_LOGPROBS = 20
# Below this temperature a request is greedy: dividing fp32 logit gaps by it overflows, and
# the distribution it asks for is the argmax anyway.
MIN_RANDOM_TEMPERATURE = 1e-5
# repetition_penalty scales a seen token's logit by at most 100x either way; tinier values
# overflow fp32 logits to inf and larger ones only repeat the same always/never outcome.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 (or below MIN_RANDOM_TEMPERATURE, or top_k 1) is greedy. top_k 0 disables
    top-k; top_p 1 and min_p 0 disable theirs. Penalties follow the usual definitions:
    repetition_penalty (in [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY]) divides positive
    logits (multiplies negative ones) of every token seen in prompt or output; presence and
    frequency penalties subtract from logits of tokens in the output. A request with a seed draws
    from its own generator, so it gets the same tokens whatever else shares its batch.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # Top-N logprobs to return per generated token (None: none). Logprobs are those of the
    # model's raw distribution (after a structured_output grammar's mask), before penalties,
    # temperature and truncation.
    logprobs: int | None = None
    # The shape the output must take (a grammar masks every step's logits); None: free text.
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Accept any iterable of ints for stop_token_ids but store a tuple (hashable, immutable).
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _check(self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be >= 1")
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
               "must be in [0, max_tokens]")
        _check(math.isfinite(self.temperature) and self.temperature >= 0, "temperature",
               self.temperature, "must be a finite number >= 0")
        _check(self.top_k >= 0 or self.top_k == -1, "top_k", self.top_k,
               "must be >= 0 (0 or -1 disables it)")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        _check(MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
               "repetition_penalty", self.repetition_penalty,
               f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}]")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty,
               "must be in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty,
               "must be in [-2, 2]")
        _check(self.seed is None or 0 <= self.seed < 2**63, "seed", self.seed,
               "must be in [0, 2**63)")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids,
               "must be token ids >= 0")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
               self.logprobs, f"must be in [0, {MAX_LOGPROBS}]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_RANDOM_TEMPERATURE or self.top_k == 1


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} {rule}")
