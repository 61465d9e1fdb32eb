"""The router's view of its workers: addresses by role, health, load, in-flight counts.

A background task, each `check_interval` seconds, re-resolves the targets (router/discovery.py)
and checks every worker (grpc.health.v1 Check, then GetLoad). A worker that fails a check,
reports NOT_SERVING (it is draining), or whose RPC fails with UNAVAILABLE, leaves the pool at
once; it rejoins when a check succeeds again. A worker whose address disappears from its target
stops receiving requests at once; its channel closes when its last request ends.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.common.logging import get_logger
from tandem.common.security import TLSFiles, open_channel
from tandem.router.discovery import Target
from tandem.v1 import worker_pb2, worker_pb2_grpc

logger = get_logger(__name__)
CHECK_TIMEOUT_SECONDS = 1.0


@dataclass(eq=False)
class WorkerEndpoint:
    address: str
    role: str  # prefill | decode | both
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    health_stub: health_pb2_grpc.HealthStub
    is_healthy: bool = False
    num_in_flight: int = 0  # requests this router has on the worker now
    load: worker_pb2.GetLoadResponse = field(default_factory=worker_pb2.GetLoadResponse)
    last_error: str = "not checked yet"
    is_removed: bool = False  # its address left its target: never picked again

    @property
    def score(self) -> tuple[float, float]:
        """Lower is better: requests in flight here (the live signal), then KV usage."""
        return (self.num_in_flight + self.load.num_waiting, self.load.kv_usage)


class WorkerPool:
    def __init__(self, prefill: list[str], decode: list[str], both: list[str],
                 check_interval: float = 1.0, tls: TLSFiles | None = None,
                 internal_token: str | None = None) -> None:
        self.check_interval = check_interval
        self.tls = tls
        self.internal_token = internal_token  # sent on every call to a worker
        self.targets = {role: [Target.parse(t) for t in targets]
                        for role, targets in (("prefill", prefill), ("decode", decode),
                                              ("both", both))}
        if not any(self.targets.values()):
            raise ValueError("no workers given: pass --prefill and --decode, or --both")
        self.workers: list[WorkerEndpoint] = []
        self.on_added: list = []  # callbacks(worker), e.g. to export its health gauge
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._check_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for worker in self.workers:
            await worker.channel.close()

    async def refresh(self) -> None:
        """Re-resolve every target, add new workers, retire vanished ones, check all."""
        wanted = set()
        for role, targets in self.targets.items():
            for target in targets:
                wanted.update((role, address) for address in await target.resolve())
        known = {(w.role, w.address) for w in self.workers if not w.is_removed}
        for role, address in sorted(wanted - known):
            self._add(role, address)
        for worker in self.workers:
            if not worker.is_removed and (worker.role, worker.address) not in wanted:
                logger.info("%s worker %s is no longer in its target; retiring it",
                            worker.role, worker.address)
                worker.is_removed, worker.is_healthy = True, False
        for worker in [w for w in self.workers if w.is_removed and w.num_in_flight == 0]:
            self.workers.remove(worker)
            await worker.channel.close()
        await self.check_all()

    def _add(self, role: str, address: str) -> WorkerEndpoint:
        channel = open_channel(address, self.tls, self.internal_token)
        worker = WorkerEndpoint(address, role, channel, worker_pb2_grpc.WorkerStub(channel),
                                health_pb2_grpc.HealthStub(channel))
        self.workers.append(worker)
        for callback in self.on_added:
            callback(worker)
        return worker

    @property
    def can_serve(self) -> bool:
        """A request can be routed: a prefill and a decode worker, or an aggregated one."""
        return bool((self.healthy("prefill") and self.healthy("decode")) or self.healthy("both"))

    def healthy(self, role: str) -> list[WorkerEndpoint]:
        return [w for w in self.workers if w.role == role and w.is_healthy and not w.is_removed]

    def pick(self, role: str) -> WorkerEndpoint | None:
        """The least loaded healthy worker of a role (load-aware; prefix affinity comes later)."""
        candidates = self.healthy(role)
        return min(candidates, key=lambda w: w.score) if candidates else None

    def mark_failed(self, worker: WorkerEndpoint, reason: str) -> None:
        if worker.is_healthy:
            logger.warning("%s worker %s left the pool: %s", worker.role, worker.address, reason)
        worker.is_healthy = False
        worker.last_error = reason

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(w) for w in self.workers if not w.is_removed))

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval)
            await self.refresh()

    async def _check(self, worker: WorkerEndpoint) -> None:
        try:
            reply = await worker.health_stub.Check(health_pb2.HealthCheckRequest(service=""),
                                                   timeout=CHECK_TIMEOUT_SECONDS)
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                raise RuntimeError(f"health is {status}")
            worker.load = await worker.stub.GetLoad(worker_pb2.GetLoadRequest(),
                                                    timeout=CHECK_TIMEOUT_SECONDS)
        except (grpc.aio.AioRpcError, RuntimeError) as exc:
            reason = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            self.mark_failed(worker, reason)
            return
        if not worker.is_healthy:
            logger.info("%s worker %s joined the pool", worker.role, worker.address)
        worker.is_healthy = True
        worker.last_error = ""
