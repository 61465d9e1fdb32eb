"""uvicorn inside the router's event loop, started and stopped by the router's own lifecycle.

uvicorn's `Server.serve` installs its own SIGINT/SIGTERM handlers and re-raises the signal
when it stops; the router handles signals itself (drain, then stop both servers), so this
server captures none. With TLS files it serves HTTPS with the router's certificate and, as the
gRPC port does, requires a client certificate signed by the CA (mutual TLS).
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from dataclasses import dataclass

import uvicorn


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield


@dataclass(frozen=True, slots=True)
class TLSPaths:
    cert: str  # PEM certificate chain
    key: str  # its private key
    ca: str  # the CA that signs client certificates


class HTTPServer:
    def __init__(self, app, host: str, port: int, grace_seconds: float,
                 tls: TLSPaths | None = None, reuse_port: bool = False) -> None:
        """reuse_port: bind with SO_REUSEPORT, beside the other router processes on the
        port."""
        ssl_args = {} if tls is None else dict(
            ssl_certfile=tls.cert, ssl_keyfile=tls.key, ssl_ca_certs=tls.ca,
            ssl_cert_reqs=ssl.CERT_REQUIRED)
        config = uvicorn.Config(app, host=host, port=port, loop="none", lifespan="off",
                                log_level="warning", access_log=False,
                                timeout_graceful_shutdown=max(1, int(grace_seconds)),
                                **ssl_args)
        self._server = _EmbeddedServer(config)
        self._reuse_port = reuse_port
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Returns once the port listens; raises ValueError when it cannot be bound."""
        self._task = asyncio.create_task(self._serve())
        while not self._server.started:
            if self._task.done():
                raise ValueError(f"cannot serve HTTP on {self._server.config.host}:"
                                 f"{self._server.config.port}")
            await asyncio.sleep(0.05)

    async def _serve(self) -> None:
        try:
            sockets = [self._shared_socket()] if self._reuse_port else None
            await self._server.serve(sockets=sockets)
        except (SystemExit, OSError):  # uvicorn's answer to a port it cannot bind (it logs why)
            pass

    def _shared_socket(self) -> socket.socket:
        config = self._server.config
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((config.host, config.port))
        except OSError:
            sock.close()
            raise
        return sock

    async def stop(self) -> None:
        """Stops accepting connections and lets in-flight responses finish (up to the grace)."""
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
