"""Where the workers of a role are, re-read on every health check.

A target is one of:
  host:port            a single worker (static)
  dns:///name:port     every address the name resolves to is a worker (a Kubernetes headless
                       Service has one A record per ready-or-not pod); scaling needs no restart
  file:///path         one host:port per line (a seam tests and scripts control); replace the
                       file whole (write a new one, rename it over the old), since a reader
                       can see a file rewritten in place empty

An answer is the whole set of workers: an address missing from it retires that worker. A lookup
that fails instead of answering (a DNS server timing out, a file missing or unreadable) raises
LookupFailed, and the pool keeps the target's last answer: a DNS hiccup must not retire a fleet
whose workers still serve. A name that does not exist, or a file that lists nobody, is an answer:
no workers.
"""
from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from pathlib import Path

# getaddrinfo errors that answer "this name has no addresses"; any other error is a failed
# lookup (EAI_AGAIN: the server did not answer in time; EAI_FAIL, EAI_SYSTEM, ...).
_NO_ADDRESSES = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


class LookupFailed(Exception):
    """A target could not be resolved now (as opposed to resolving to no workers)."""


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
        """Current worker addresses; [] when the name does not exist (yet). Raises
        LookupFailed when the answer cannot be had now."""
        if self.kind == "static":
            return [self.value]
        if self.kind == "file":
            try:
                lines = Path(self.value).read_text().splitlines()
            except OSError as exc:
                raise LookupFailed(f"cannot read {self.value}: {exc.strerror or exc}") from exc
            return [line.strip() for line in lines if line.strip()]
        host, port = _split_port(self.value, self.value)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            if exc.errno in _NO_ADDRESSES:
                return []
            raise LookupFailed(f"DNS lookup of {host} failed: {exc.strerror or exc}") from exc
        addresses = {info[4][0] for info in infos}
        return sorted(f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in addresses)


def _split_port(text: str, original: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"worker target {original!r} is not host:port, dns:///name:port or "
                         "file:///path")
    return host.strip("[]"), int(port)
