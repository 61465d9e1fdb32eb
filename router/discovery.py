"""Where the workers of a role are, re-read on every health check.

A target is one of:
  host:port            a single worker (static)
  dns:///name:port     every address the name resolves to is a worker (a Kubernetes headless
                       Service has one A record per ready-or-not pod); scaling needs no restart
  file:///path         one host:port per line (a seam tests and scripts control)
"""
from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Target:
    kind: str  # static | dns | file
    value: str  # host:port, name:port, or a path

    @classmethod
    def parse(cls, text: str) -> Target:
        if text.startswith("dns:///"):
            name = text.removeprefix("dns:///")
            _split_port(name, text)
            return cls("dns", name)
        if text.startswith("file://"):
            return cls("file", text.removeprefix("file://"))
        _split_port(text, text)
        return cls("static", text)

    async def resolve(self) -> list[str]:
        """Current worker addresses; [] when the name does not resolve (yet)."""
        if self.kind == "static":
            return [self.value]
        if self.kind == "file":
            try:
                lines = Path(self.value).read_text().splitlines()
            except OSError:
                return []
            return [line.strip() for line in lines if line.strip()]
        host, port = _split_port(self.value, self.value)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM)
        except socket.gaierror:
            return []
        addresses = {info[4][0] for info in infos}
        return sorted(f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in addresses)


def _split_port(text: str, original: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"worker target {original!r} is not host:port, dns:///name:port or "
                         "file:///path")
    return host.strip("[]"), int(port)
