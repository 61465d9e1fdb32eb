"""Serve stand-in gRPC servicers on 127.0.0.1 from a background thread."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.common.security import add_port
from tandem.v1 import generate_pb2_grpc, worker_pb2, worker_pb2_grpc


@contextmanager
def serve(register: Callable[[grpc.aio.Server], None], port: int = 0, tls=None,
          interceptors=()) -> Iterator[str]:
    """Yields the host:port of a grpc.aio server set up by `register(server)` (on `port`, or
    a free one); stops it on exit. tls: a tandem.common.security.TLSFiles for mutual TLS;
    interceptors: server interceptors."""
    loop, started, state = asyncio.new_event_loop(), threading.Event(), {}

    async def run():
        server = grpc.aio.server(interceptors=list(interceptors))
        register(server)
        state["port"] = add_port(server, f"127.0.0.1:{port}", tls)
        state["stop"] = asyncio.Event()
        await server.start()
        started.set()
        await state["stop"].wait()
        await server.stop(0)

    thread = threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True)
    thread.start()
    assert started.wait(10), "stand-in server did not start"
    try:
        yield f"127.0.0.1:{state['port']}"
    finally:
        loop.call_soon_threadsafe(state["stop"].set)
        thread.join(10)
        loop.close()


@contextmanager
def serve_generate(servicer, tls=None, interceptors=()) -> Iterator[str]:
    """A stand-in tandem.v1.Generate servicer (mutual TLS and interceptors as for serve)."""
    with serve(lambda server: generate_pb2_grpc.add_GenerateServicer_to_server(
            servicer, server), tls=tls, interceptors=interceptors) as address:
        yield address


class StandinWorker(health_pb2_grpc.HealthServicer, worker_pb2_grpc.WorkerServicer):
    """Answers the router's health checks (grpc.health.v1 Check, then Worker/GetLoad) with
    `status` after `check_delay_seconds`; set both from any thread. GetLoad reports
    `instance_id` and which asked-about ids are in `held_request_ids`; Abort drops an id from
    it (and records it in `aborted`)."""

    def __init__(self, instance_id: str = "standin-1") -> None:
        self.status = health_pb2.HealthCheckResponse.SERVING
        self.check_delay_seconds = 0.0
        self.num_checks = 0
        self.instance_id = instance_id
        self.held_request_ids: set[str] = set()
        self.aborted: list[str] = []

    async def Check(self, request, context):  # noqa: N802 (gRPC's naming)
        self.num_checks += 1
        await asyncio.sleep(self.check_delay_seconds)
        return health_pb2.HealthCheckResponse(status=self.status)

    async def GetLoad(self, request, context):  # noqa: N802
        return worker_pb2.GetLoadResponse(
            instance_id=self.instance_id,
            held_request_ids=[i for i in request.request_ids if i in self.held_request_ids])

    async def Abort(self, request, context):  # noqa: N802
        self.aborted.append(request.request_id)
        found = request.request_id in self.held_request_ids
        self.held_request_ids.discard(request.request_id)
        return worker_pb2.AbortResponse(found=found)

    def register(self, server: grpc.aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self, server)
        worker_pb2_grpc.add_WorkerServicer_to_server(self, server)
