"""The router's view of its workers: addresses by role, health, load, in-flight counts.

A background task, each `check_interval_seconds`, re-resolves the targets (router/discovery.py)
and starts a check of every worker that has none running (grpc.health.v1 Check, then GetLoad,
each within `check_timeout_seconds`), so a slow worker never delays the others' checks. Who is
in the routing pool follows router/ejection.py: a worker that cannot be reached, answers
NOT_SERVING (it is draining) or fails a request leaves at once; one that is merely slow leaves
after `failure_threshold` failed checks in a row; each comes back after its backoff, on a good
check. Two things a check learns from GetLoad decide more: a new instance id (the worker
restarted) starts its history over, so a new process is not held to its predecessor's backoff;
and an ejected worker still holding requests the router gave up on there (a frozen worker,
thawed, whose requests moved away) gets their Aborts again and stays out until a check finds
none of them, so it rejoins with no KV in use for work that runs elsewhere or ended.
An ejected worker with no request in flight gets a fresh channel after each failed check:
gRPC's reconnect backoff on the old one (it grows to minutes) would hide a restarted worker from
the checks long after it serves. A worker whose address disappears from its target stops
receiving requests at once; its channel closes when its last request ends. A lookup that fails
(router/discovery.py LookupFailed) keeps the target's last answer, so only an answer retires.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.common.logging import get_logger
from tandem.common.metrics import RouterMetrics
from tandem.common.security import TLSFiles, open_channel
from tandem.router.decode_streams import DecodeStream
from tandem.router.discovery import LookupFailed, Target
from tandem.router.ejection import HealthPolicy, OutlierState
from tandem.v1 import worker_pb2, worker_pb2_grpc

logger = get_logger(__name__)
# The receive window stays at HTTP/2's default instead of growing with the bandwidth-delay
# product: a worker's DecodeStream can then run only a few messages ahead of this router's
# reading, so while the router is behind, the worker folds every step since into its next
# message (one client chunk per request) rather than queueing a small message per step here.
WORKER_CHANNEL_OPTIONS = (("grpc.http2.bdp_probe", 0),)


@dataclass(eq=False)
class WorkerEndpoint:
    address: str
    role: str  # prefill | decode | both
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    health_stub: health_pb2_grpc.HealthStub
    outlier: OutlierState
    num_in_flight: int = 0  # requests this router has on the worker now
    load: worker_pb2.GetLoadResponse = field(default_factory=worker_pb2.GetLoadResponse)
    # This router's requests on the worker while `load` was read (the most it had in flight
    # from sending GetLoad to its reply): the part of the reported queue that is its own.
    in_flight_at_load: int = 0
    last_error: str = "not checked yet"
    is_removed: bool = False  # its address left its target: never picked again
    instance_id: str = ""  # the worker process's, from its latest GetLoad
    # Worker-side ids of requests the router gave up on here after the worker failed them;
    # it rejoins the pool only once it holds none of them.
    abandoned_request_ids: set[str] = field(default_factory=set)
    decode_stream: DecodeStream = field(default_factory=DecodeStream)  # carries every Decode

    @property
    def is_healthy(self) -> bool:
        """In the routing pool: may receive new requests."""
        return self.outlier.is_in_pool and not self.is_removed

    @property
    def process_key(self) -> tuple[str, str]:
        """The worker process: a restart at the same address is another one."""
        return (self.address, self.instance_id)

    @property
    def score(self) -> tuple[float, float]:
        """Lower is better: requests in flight here (the live signal), then KV usage."""
        return (self.num_in_flight + self.load.num_waiting, self.load.kv_usage)


class WorkerPool:
    def __init__(self, prefill: list[str], decode: list[str], both: list[str],
                 health: HealthPolicy = HealthPolicy(), tls: TLSFiles | None = None,
                 metrics: RouterMetrics | None = None,
                 internal_token: str | None = None) -> None:
        self.health = health
        self.tls = tls
        self.metrics = metrics
        self.internal_token = internal_token  # sent on every call to a worker
        self.targets = {role: [Target.parse(t) for t in targets]
                        for role, targets in (("prefill", prefill), ("decode", decode),
                                              ("both", both))}
        if not any(self.targets.values()):
            raise ValueError("no workers given: pass --prefill and --decode, or --both")
        self.workers: list[WorkerEndpoint] = []
        self.on_added: list = []  # callbacks(worker), e.g. to export its health gauge
        self.policy = None  # a routing_policy.RoutingPolicy; None: least loaded
        self._task: asyncio.Task | None = None
        self._checks: dict[WorkerEndpoint, asyncio.Task] = {}  # the check running per worker
        # Per (role, target): its latest answer; and, while its lookups fail, the latest reason.
        self._answers: dict[tuple[str, Target], list[str]] = {}
        self._lookup_errors: dict[tuple[str, Target], str] = {}

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._check_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        checks = list(self._checks.values())
        for task in checks:
            task.cancel()
        await asyncio.gather(*checks, return_exceptions=True)
        for worker in self.workers:
            await worker.channel.close()

    async def refresh(self) -> None:
        """Re-resolve every target, add new workers, retire vanished ones, check all."""
        await self._resolve()
        await self.check_all()

    async def _resolve(self) -> None:
        wanted = set()
        for role, targets in self.targets.items():
            for target in targets:
                wanted.update((role, address) for address in await self._lookup(role, target))
        known = {(w.role, w.address) for w in self.workers if not w.is_removed}
        for role, address in sorted(wanted - known):
            self._add(role, address)
        for worker in self.workers:
            if not worker.is_removed and (worker.role, worker.address) not in wanted:
                logger.info("%s worker %s is no longer in its target; retiring it",
                            worker.role, worker.address)
                worker.is_removed = True
        for worker in [w for w in self.workers if w.is_removed and w.num_in_flight == 0]:
            self.workers.remove(worker)
            check = self._checks.pop(worker, None)
            if check is not None:
                check.cancel()
            await worker.channel.close()

    async def _lookup(self, role: str, target: Target) -> list[str]:
        """The target's addresses now, or its last answer while a lookup fails (none before
        its first answer). Logs each failure reason once, and the recovery."""
        key = (role, target)
        try:
            self._answers[key] = await target.resolve()
        except LookupFailed as exc:
            if self._lookup_errors.get(key) != str(exc):
                last = self._answers.get(key)
                kept = ("none known until it answers" if last is None
                        else f"keeping its last answer, {len(last)} worker(s)")
                logger.warning("%s workers: %s; %s", role, exc, kept)
            self._lookup_errors[key] = str(exc)
            return self._answers.get(key, [])
        if self._lookup_errors.pop(key, ""):
            logger.info("%s target %s answers again: %d worker(s)", role, target.value,
                        len(self._answers[key]))
        return self._answers[key]

    def _add(self, role: str, address: str) -> WorkerEndpoint:
        worker = WorkerEndpoint(address, role, *self._connect(address),
                                outlier=OutlierState(self.health))
        self.workers.append(worker)
        for callback in self.on_added:
            callback(worker)
        return worker

    def _connect(self, address: str):
        channel = open_channel(address, self.tls, self.internal_token, WORKER_CHANNEL_OPTIONS)
        return channel, worker_pb2_grpc.WorkerStub(channel), health_pb2_grpc.HealthStub(channel)

    async def _reconnect(self, worker: WorkerEndpoint) -> None:
        old_channel = worker.channel
        worker.channel, worker.stub, worker.health_stub = self._connect(worker.address)
        await old_channel.close()

    @property
    def can_serve(self) -> bool:
        """A request can be routed: a prefill and a decode worker, or an aggregated one."""
        return bool((self.healthy("prefill") and self.healthy("decode")) or self.healthy("both"))

    def healthy(self, role: str) -> list[WorkerEndpoint]:
        return [w for w in self.workers if w.role == role and w.is_healthy]

    def pick(self, *roles: str, exclude: Collection[tuple[str, str]] = (), prompt_token_ids=(),
             note=None) -> WorkerEndpoint | None:
        """A healthy worker of these roles whose process_key is not in `exclude`, as the
        routing policy chooses (router/routing_policy.py); without one, the least loaded."""
        candidates = [w for role in roles for w in self.healthy(role)
                      if w.process_key not in exclude]
        if self.policy is not None:
            return self.policy.pick(candidates, prompt_token_ids, note)
        return min(candidates, key=lambda w: w.score) if candidates else None

    def mark_failed(self, worker: WorkerEndpoint, reason: str, cause: str = "request") -> None:
        """A request on `worker` failed or stalled: eject it at once."""
        self._record_failure(worker, reason, cause, is_hard=True)

    def note_abandoned(self, worker: WorkerEndpoint, request_id: str) -> None:
        """The router gave up on `request_id` on `worker` after a failure there (the request
        moved to another worker or failed; the flow sent its Abort). While the worker is out
        of the pool it rejoins only once a check finds it no longer holds the request; a
        worker still in the pool ended the request itself."""
        if not worker.outlier.is_in_pool:
            worker.abandoned_request_ids.add(request_id)

    def _record_failure(self, worker: WorkerEndpoint, reason: str, cause: str,
                        is_hard: bool) -> None:
        worker.last_error = reason
        if not worker.outlier.record_failure(time.monotonic(), is_hard):
            return
        logger.warning("%s worker %s ejected from the pool for %.1f s (%s): %s", worker.role,
                       worker.address, worker.outlier.backoff_seconds, cause, reason)
        if self.metrics is not None:
            self.metrics.worker_ejections.labels(worker=worker.address, role=worker.role,
                                                 cause=cause).inc()

    def _record_success(self, worker: WorkerEndpoint) -> None:
        worker.last_error = ""
        was_ejected = worker.outlier.joined_at is not None
        if not worker.outlier.record_success(time.monotonic()):
            return
        logger.info("%s worker %s %s the pool", worker.role, worker.address,
                    "rejoined" if was_ejected else "joined")
        if was_ejected and self.metrics is not None:
            self.metrics.worker_rejoins.labels(worker=worker.address, role=worker.role).inc()

    async def check_all(self) -> None:
        """Checks every worker once (joining the checks already running)."""
        await asyncio.gather(*self._start_checks(), return_exceptions=True)

    def _start_checks(self) -> list[asyncio.Task]:
        tasks = []
        for worker in self.workers:
            if worker.is_removed:
                continue
            if worker not in self._checks:
                task = asyncio.create_task(self._check(worker))
                self._checks[worker] = task
                task.add_done_callback(lambda t, w=worker: self._check_done(w, t))
            tasks.append(self._checks[worker])
        return tasks

    def _check_done(self, worker: WorkerEndpoint, task: asyncio.Task) -> None:
        if self._checks.get(worker) is task:
            del self._checks[worker]
        if not task.cancelled() and task.exception() is not None:
            logger.warning("health check of %s worker %s crashed: %r", worker.role,
                           worker.address, task.exception())

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health.check_interval_seconds)
            await self._resolve()
            self._start_checks()

    async def _check(self, worker: WorkerEndpoint) -> None:
        timeout = self.health.check_timeout_seconds
        try:
            reply = await worker.health_stub.Check(health_pb2.HealthCheckRequest(service=""),
                                                   timeout=timeout)
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                self._record_failure(worker, f"health is {status}", "not_serving", True)
            else:
                in_flight_at_send = worker.num_in_flight
                load = await worker.stub.GetLoad(worker_pb2.GetLoadRequest(
                    request_ids=sorted(worker.abandoned_request_ids)), timeout=timeout)
                worker.load = load
                worker.in_flight_at_load = max(in_flight_at_send, worker.num_in_flight)
                self._note_instance(worker, load.instance_id)
                worker.abandoned_request_ids.intersection_update(load.held_request_ids)
                if not worker.abandoned_request_ids:
                    self._record_success(worker)
                    return
                reason = (f"still holds {len(worker.abandoned_request_ids)} request(s) the "
                          "router gave up on; aborting them again")
                if reason != worker.last_error:  # once per change, not on every probe
                    logger.info("%s worker %s stays out of the pool: %s", worker.role,
                                worker.address, reason)
                worker.last_error = reason
                await self._abort_abandoned(worker, timeout)
                return
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            is_unreachable = code == grpc.StatusCode.UNAVAILABLE
            self._record_failure(worker, f"health check: {code.name}: {exc.details()}",
                                 "unreachable" if is_unreachable else "failed_checks",
                                 is_hard=is_unreachable)
        if not worker.is_healthy and not worker.is_removed and worker.num_in_flight == 0:
            await self._reconnect(worker)

    def _note_instance(self, worker: WorkerEndpoint, instance_id: str) -> None:
        """A new instance id at the worker's address is a restarted process: what the old one
        earned (failures, backoff, requests it held) no longer applies."""
        if instance_id == worker.instance_id:
            return
        if worker.instance_id and instance_id:
            logger.info("%s worker %s restarted (instance %s, was %s): its failures and "
                        "ejection backoff start over", worker.role, worker.address,
                        instance_id, worker.instance_id)
            worker.outlier.start_over()
            worker.abandoned_request_ids.clear()
        worker.instance_id = instance_id

    @staticmethod
    async def _abort_abandoned(worker: WorkerEndpoint, timeout: float) -> None:
        await asyncio.gather(*(worker.stub.Abort(worker_pb2.AbortRequest(request_id=request_id),
                                                 timeout=timeout)
                               for request_id in sorted(worker.abandoned_request_ids)),
                             return_exceptions=True)
