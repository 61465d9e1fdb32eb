"""The rate sweep of bench/disagg.py: SLO attainment, goodput, and which rate to run next.

Definitions (the "SLO attainment" goodput of DistServe, OSDI '24):
  attainment(rate)  the fraction of a run's measured requests that succeeded with
                    TTFT <= slo_ttft and TPOT <= slo_tpot (failed requests count as misses;
                    a one-token request has no TPOT and meets that part).
  goodput           the highest Poisson rate whose run attains >= `target` (0.9): sweeping the
                    rates in increasing order, the last passing rate below the first failing
                    one, interpolated linearly in attainment between the two (so a coarse rate
                    grid does not quantize the ratio). No failing rate: goodput >= the highest
                    rate run ("at least"); no passing rate: < the lowest ("below").
  kept up           (reported, not part of goodput) completions / arrivals over the second half
                    of a run's arrivals: about 1 while the stack keeps pace, 1/k at k-fold
                    overload; noisy (+-10-15%) in runs a few request lifetimes long.

Short runs bias a throughput-bound goodput up: at k-fold overload a request arriving t seconds
into the run queues about (k - 1) t, so with --run-seconds D and a TTFT SLO S the run still
attains 90% up to k = 1 + S / (0.9 D) (S = 1 s, D = 8 s: 14%). A TPOT-bound layout has no such
bias (TPOT grows with load at once), so a ratio between a throughput-bound and a TPOT-bound
layout can be off by up to that much; longer runs shrink it.

The sweep (RateSweep) is adaptive: it starts at `start` and multiplies the rate by `factor`
while runs pass the stop SLO, then refines the bracket once at its geometric mean; if the
first run fails it steps down (twice at most). The stop SLO is the loosest of the SLOs the
report uses, so every one of them gets its bracket from the same runs. The caller also stops
when its time allowance would be exceeded, and the goodput of an SLO whose failure was not
reached is then a lower bound.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Goodput", "RatePoint", "RateSweep", "attainment", "goodput", "kept_up",
           "ratio", "samples_of"]


@dataclass(slots=True)
class RatePoint:
    """One run: its rate and, per measured request, (ttft_s, tpot_s, ok)."""
    rate: float
    samples: list[tuple[float | None, float | None, bool]]
    seconds: float = 0.0


def kept_up(records) -> float | None:
    """Completions / arrivals of measured requests between the median and the last arrival
    (the module docstring's "kept up"); None with fewer than 8 measured requests."""
    measured = [r for r in records if not r.is_warmup]
    starts = sorted(r.start_s for r in measured)
    if len(starts) < 8 or starts[-1] <= starts[len(starts) // 2]:
        return None
    begin, end = starts[len(starts) // 2], starts[-1]
    arrived = sum(begin <= s <= end for s in starts)
    done = sum(r.is_ok and begin <= r.end_s <= end for r in measured)
    return done / arrived


def samples_of(records) -> list[tuple[float | None, float | None, bool]]:
    """(ttft_s, tpot_s, ok) of each measured request (bench/records.py RequestRecords)."""
    return [(r.ttft_s, r.tpot_s, r.is_ok) for r in records if not r.is_warmup]


def attainment(samples: Sequence[tuple], slo_ttft_s: float, slo_tpot_s: float) -> float:
    if not samples:
        return 0.0
    good = sum(ok and ttft is not None and ttft <= slo_ttft_s
               and (tpot is None or tpot <= slo_tpot_s) for ttft, tpot, ok in samples)
    return good / len(samples)


@dataclass(frozen=True, slots=True)
class Goodput:
    value: float | None  # req/s; None when no rate passed
    kind: str  # "bracketed" | "at least" | "below" | "none" (no runs)
    passing: float | None = None  # the highest passing rate below the first failing one
    failing: float | None = None  # the first failing rate

    def __str__(self) -> str:
        if self.kind == "bracketed":
            return f"{self.value:.2f}"
        if self.kind == "at least":
            return f">={self.value:.2f}"
        if self.kind == "below":
            return f"<{self.failing:.2f}"
        return "n/a"


def score(point: RatePoint, slo_ttft_s: float, slo_tpot_s: float, target: float) -> float:
    """>= 1 when the run passes: attainment / target."""
    return attainment(point.samples, slo_ttft_s, slo_tpot_s) / target


def goodput(points: Sequence[RatePoint], slo_ttft_s: float, slo_tpot_s: float,
            target: float = 0.9) -> Goodput:
    """The module docstring's goodput over the runs in `points` (any order)."""
    if not points:
        return Goodput(None, "none")
    passing = None
    for point in sorted(points, key=lambda p: p.rate):
        value = score(point, slo_ttft_s, slo_tpot_s, target)
        if value >= 1:
            passing = (point.rate, value)
            continue
        if passing is None:
            return Goodput(None, "below", None, point.rate)
        (low, s_low), (high, s_high) = passing, (point.rate, value)
        rate = low + (s_low - 1) / (s_low - s_high) * (high - low)
        return Goodput(rate, "bracketed", low, high)
    return Goodput(passing[0], "at least", passing[0], None)


def ratio(a: Goodput, b: Goodput) -> str:
    """a / b as text, marking bounds: '>=1.52x', '<=0.8x', '?' when unknown."""
    if a.value is None and b.value is None:
        return "?"
    if a.value is None:  # below its lowest rate, or not run at all (no bound)
        return f"<{a.failing / b.value:.2f}x" if b.value and a.failing else "?"
    if b.value is None:
        return f">{a.value / b.failing:.2f}x" if b.failing else "?"
    text = f"{a.value / b.value:.2f}x"
    lower, upper = a.kind == "at least", b.kind == "at least"
    if lower and upper:
        return "?"  # two lower bounds: no saturation reached for either
    return (">=" if lower else "<=" if upper else "") + text


@dataclass
class RateSweep:
    """Which rate to run next, given the runs so far (see the module docstring)."""
    start: float
    factor: float = 1.5
    stop_slo: tuple[float, float] = (2.0, 0.05)  # (ttft, tpot) seconds: the loosest reported
    target: float = 0.9
    max_rate: float = 1000.0
    max_steps_down: int = 2
    _refined: bool = field(default=False, init=False)

    def next_rate(self, points: Sequence[RatePoint]) -> float | None:
        if not points:
            return self.start
        result = goodput(points, *self.stop_slo, self.target)
        rates = sorted(p.rate for p in points)
        if result.kind == "at least":
            up = rates[-1] * self.factor
            return up if up <= self.max_rate else None
        if result.kind == "below":
            down = rates[0] / self.factor
            floor = self.start / self.factor ** self.max_steps_down
            return down if down >= floor * (1 - 1e-9) else None
        low, high = result.passing, result.failing
        middle = math.sqrt(low * high)
        if self._refined or high / low < math.sqrt(self.factor) * (1 + 1e-9) or any(
                abs(r - middle) < 1e-9 for r in rates):
            return None
        self._refined = True
        return middle
