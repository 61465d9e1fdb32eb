"""A request's attempts across workers: which workers it reached under which worker-side id,
which worker processes failed it, and whether it may move once more (`--migration-limit`).

Every attempt has its own worker-side request id (the call's id, then `<id>.m1`, `<id>.m2`,
...), so a failed worker that is still running the request (frozen, then thawed) can never
touch the attempt that replaced it. Each attempt's workers get exactly one Abort from the
flow: at the failure for a failed attempt, at the end of the call for the last one.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import grpc

from tandem.router.validation import RequestError
from tandem.router.worker_pool import WorkerEndpoint


@dataclass(slots=True)
class Attempt:
    request_id: str  # what the attempt's workers know the request by
    workers: list[WorkerEndpoint] = field(default_factory=list)


class MigrationLog:
    def __init__(self, worker_request_id: str, migration_limit: int) -> None:
        if migration_limit < 0:
            raise ValueError(f"migration_limit={migration_limit} must be >= 0")
        self.base_request_id = worker_request_id
        self.migration_limit = migration_limit
        self.attempts = [Attempt(worker_request_id)]
        self.failures: list[str] = []  # one line per failed attempt, for the final error
        # WorkerEndpoint.process_key of each worker that failed the request: never picked
        # again for it (a restarted process at the same address may be)
        self.failed_workers: set[Hashable] = set()

    @property
    def current(self) -> Attempt:
        return self.attempts[-1]

    @property
    def num_migrations(self) -> int:
        return len(self.attempts) - 1

    def record_failure(self, worker: Hashable, message: str) -> Attempt:
        """The current attempt failed on `worker` (its process_key); returns the attempt (its
        workers need an Abort) and opens the next one, or raises UNAVAILABLE naming every
        attempt once the limit is reached."""
        failed = self.current
        self.failures.append(message)
        self.failed_workers.add(worker)
        if self.num_migrations >= self.migration_limit:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, self.describe(
                f"the request failed on {len(self.failures)} worker(s) "
                f"(--migration-limit {self.migration_limit})"))
        self.attempts.append(Attempt(f"{self.base_request_id}.m{len(self.attempts)}"))
        return failed

    def describe(self, summary: str) -> str:
        return f"{summary}: " + "; ".join(
            f"attempt {i + 1}: {line}" for i, line in enumerate(self.failures))
