"""Ports for child servers a process starts: picked free, never handed out twice.

A parent (`tandem up`, the router's supervisor, a test) picks ports for the servers it is about
to start and passes them on the command line; each port stays unbound until its child binds it.
"""
from __future__ import annotations

import random
import socket
import threading
from collections.abc import Collection
from pathlib import Path

# Ports free_port picks from start here and end below the kernel's ephemeral range.
LOWEST_PICKED_PORT = 20000
_port_picker = random.Random()
_handed_out: set[int] = set()  # every port free_port returned in this process
_handed_out_lock = threading.Lock()


def free_port(host: str = "127.0.0.1", *, avoid: Collection[int] = ()) -> int:
    """A TCP port free on `host` now, for a child process to bind soon after.

    Picked at random below the kernel's ephemeral port range: ports in that range are also
    handed out as the local ends of outgoing connections (health checks, NCCL/gloo, HTTP
    scrapes), and one of those can take a port between its choice here and the child's bind.
    A port is free here until its child binds it, so one process never gets the same port
    twice (two children of a stack would collide), nor one in `avoid` (ports already promised
    elsewhere, e.g. the router's --port). Another listener still may take it; a child that
    cannot bind fails naming the address.
    """
    low = _ephemeral_range_start()
    with _handed_out_lock:
        if low - LOWEST_PICKED_PORT >= 1000:
            for _ in range(64):
                port = _port_picker.randrange(LOWEST_PICKED_PORT, low)
                if port not in _handed_out and port not in avoid and _can_bind(host, port):
                    _handed_out.add(port)
                    return port
        while True:  # the kernel's choice; it too may repeat once the first socket closes
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
            if port not in _handed_out and port not in avoid:
                _handed_out.add(port)
                return port


def _can_bind(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def _ephemeral_range_start() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768, its default, elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
