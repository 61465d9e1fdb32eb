"""Outlier ejection: when a worker leaves the routing pool, and when it may come back.

    (not yet checked) --good check--> IN POOL --hard failure, or failure_threshold failed
          ^                             ^       checks in a row--> EJECTED (for its backoff)
          |                             '--first good check after the backoff (the probe)--'

A hard failure ejects at once: the worker cannot be reached (UNAVAILABLE), answers
NOT_SERVING, or a request on it failed or stalled. A soft one (a check that times out or
errs otherwise) only counts, so a worker too busy to answer one check in time keeps serving.

An ejected worker is still checked; while its backoff runs, good checks do not bring it back,
and after it the next good check does (half-open: one probe, not a timer, decides). The backoff
is `base_ejection_seconds`, doubled for each ejection that follows a rejoin by less than
`max_ejection_seconds` (a flapping worker), capped there. A worker that was down longer than
its backoff rejoins on its first good check. A restarted worker (a new process at the same
address, told apart by its instance id) is a new worker: `start_over` forgets the old one's
failures and backoff, so its first good check brings it in.
"""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """How the router checks its workers (the router's --health-* and --ejection-* flags)."""

    check_interval_seconds: float = 1.0
    check_timeout_seconds: float = 5.0
    failure_threshold: int = 3  # failed checks in a row that eject a worker
    base_ejection_seconds: float = 2.0
    max_ejection_seconds: float = 60.0

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if not value > 0:
                raise ValueError(f"HealthPolicy.{field.name}={value} must be > 0")
        if self.max_ejection_seconds < self.base_ejection_seconds:
            raise ValueError(f"HealthPolicy.max_ejection_seconds={self.max_ejection_seconds} "
                             f"must be >= base_ejection_seconds={self.base_ejection_seconds}")


class OutlierState:
    """One worker's place in the pool. Times are time.monotonic() seconds, passed in."""

    def __init__(self, policy: HealthPolicy) -> None:
        self.policy = policy
        self.is_in_pool = False
        self.num_failed_checks = 0  # in a row, while in the pool
        self.num_ejections_in_a_row = 0  # each within max_ejection_seconds of a rejoin
        self.backoff_seconds = 0.0  # of the latest ejection
        self.ejected_until = 0.0
        self.joined_at: float | None = None

    def record_success(self, now: float) -> bool:
        """A good check. True when it brings the worker into the pool."""
        self.num_failed_checks = 0
        if self.is_in_pool or now < self.ejected_until:
            return False
        self.is_in_pool = True
        self.joined_at = now
        return True

    def start_over(self) -> None:
        """A new process serves at the address: no failures, no backoff (still out of the pool
        until a good check)."""
        self.num_failed_checks = 0
        self.num_ejections_in_a_row = 0
        self.backoff_seconds = 0.0
        self.ejected_until = 0.0

    def record_failure(self, now: float, is_hard: bool) -> bool:
        """A failed check or request. True when it ejects the worker."""
        if not self.is_in_pool:
            return False
        self.num_failed_checks += 1
        if not is_hard and self.num_failed_checks < self.policy.failure_threshold:
            return False
        policy = self.policy
        is_flapping = self.joined_at is not None and \
            now - self.joined_at < policy.max_ejection_seconds
        self.num_ejections_in_a_row = self.num_ejections_in_a_row + 1 if is_flapping else 1
        self.backoff_seconds = min(policy.base_ejection_seconds
                                   * 2 ** min(self.num_ejections_in_a_row - 1, 30),
                                   policy.max_ejection_seconds)
        self.ejected_until = now + self.backoff_seconds
        self.is_in_pool = False
        self.num_failed_checks = 0
        return True
