"""uvicorn inside the router's event loop, started and stopped by the router's own lifecycle.

uvicorn's `Server.serve` installs its own SIGINT/SIGTERM handlers and re-raises the signal
when it stops; the router handles signals itself (drain, then stop both servers), so this
server captures none.
"""
from __future__ import annotations

import asyncio
import contextlib

import uvicorn


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HTTPServer:
    def __init__(self, app, host: str, port: int, grace_seconds: float) -> None:
        config = uvicorn.Config(app, host=host, port=port, loop="none", lifespan="off",
                                log_level="warning", access_log=False,
                                timeout_graceful_shutdown=max(1, int(grace_seconds)))
        self._server = _EmbeddedServer(config)
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
            await self._server.serve()
        except SystemExit:  # uvicorn's answer to a port it cannot bind (it logs why)
            pass

    async def stop(self) -> None:
        """Stops accepting connections and lets in-flight responses finish (up to the grace)."""
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
