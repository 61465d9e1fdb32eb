"""Serve a stand-in tandem.v1.Generate servicer on 127.0.0.1 from a background thread."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from tandem.common.security import add_port
from tandem.v1 import generate_pb2_grpc


@contextmanager
def serve_generate(servicer, tls=None, interceptors=()) -> Iterator[str]:
    """Yields the host:port of a grpc.aio server running `servicer`; stops it on exit.
    tls: a tandem.common.security.TLSFiles for mutual TLS; interceptors: server interceptors."""
    loop, started, state = asyncio.new_event_loop(), threading.Event(), {}

    async def serve():
        server = grpc.aio.server(interceptors=list(interceptors))
        generate_pb2_grpc.add_GenerateServicer_to_server(servicer, server)
        state["port"] = add_port(server, "127.0.0.1:0", tls)
        state["stop"] = asyncio.Event()
        await server.start()
        started.set()
        await state["stop"].wait()
        await server.stop(0)

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(10), "stand-in Generate server did not start"
    try:
        yield f"127.0.0.1:{state['port']}"
    finally:
        loop.call_soon_threadsafe(state["stop"].set)
        thread.join(10)
