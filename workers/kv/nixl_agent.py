"""One NIXL agent with its UCX backend: the few NIXL calls the nixl KV backend makes.

    agent = NixlAgent(name)                                  # UCX backend, progress thread
    registered = agent.register([(address, bytes, device_id)], "DRAM" | "VRAM")
    agent.metadata() -> bytes        peer = agent.load_peer(metadata)   agent.unload_peer(peer)
    xfer = agent.post_read(local_rows, "DRAM", remote_rows, "VRAM", peer)   # [N, 3] uint64
    agent.state(xfer) -> "DONE" | "PROC" | "ERR";  agent.release(xfer)

Built on NIXL's bindings (the module under nixl._api) rather than nixl._api.nixl_agent, for
one reason: nixl_agent starts NIXL's progress thread with a delay of 0 us, and that thread
then spins a whole core per agent even when idle (measured with nixl-cu13 1.5.1: 2.9 CPU
seconds per 3 s idle). With PROGRESS_DELAY_US it costs about 4% of a core and a 16 MiB READ
is as fast. The thread cannot be left off: a READ completes only while the *source* agent
makes progress (over UCX's tcp transport the source answers every get; over shared memory
the connection set-up needs it too; measured: a READ stays in progress forever otherwise).

Every call is made from one thread (NIXL_THREAD_SYNC_NONE): the worker's event loop.
"""
from __future__ import annotations

import importlib
import importlib.util

# The meta package `nixl` picks the wheel matching the CUDA it detects; `tandem[nixl]`
# installs nixl-cu13 alone, which imports as nixl_cu13.
_PACKAGES = ("nixl", "nixl_cu13", "nixl_cu12")
PROGRESS_DELAY_US = 100  # the progress thread's sleep when it found nothing to progress
MEM_TYPES = ("DRAM", "VRAM")


class NixlUnavailable(RuntimeError):
    """NIXL cannot be used (not installed, no UCX plugin, a peer's agent did not load)."""


def is_installed() -> bool:
    """Whether a NIXL wheel is installed, without importing it."""
    return any(importlib.util.find_spec(name) is not None for name in _PACKAGES)


def _load_bindings():
    errors = []
    for name in _PACKAGES:
        try:
            return importlib.import_module(f"{name}._bindings")
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise NixlUnavailable("NIXL is not installed (pip install 'tandem[nixl]'): "
                          + "; ".join(errors))


class NixlAgent:
    def __init__(self, name: str) -> None:
        bind = self._bind = _load_bindings()
        config = bind.nixlAgentConfig()
        config.useProgThread = True
        config.pthrDelay = PROGRESS_DELAY_US
        config.useListenThread = False  # metadata travels over Tandem's own gRPC
        config.syncMode = bind.NIXL_THREAD_SYNC_NONE
        config.captureTelemetry = False
        try:
            self._agent = bind.nixlAgent(name, config)
        except Exception as exc:  # NIXL raises its own exception types
            raise NixlUnavailable(f"creating NIXL agent {name} failed: {exc}") from exc
        plugins = self._agent.getAvailPlugins()
        if "UCX" not in plugins:
            raise NixlUnavailable(f"NIXL has no UCX plugin (plugins: {plugins})")
        try:
            self._ucx = self._agent.createBackend("UCX", {})
        except Exception as exc:  # e.g. UCX_TLS naming no usable transport
            raise NixlUnavailable(f"NIXL's UCX backend did not start: {exc} (check UCX_TLS "
                                  f"and UCX_NET_DEVICES)") from exc
        self._mems = {"DRAM": bind.DRAM_SEG, "VRAM": bind.VRAM_SEG}
        self.name = name

    def register(self, regions: list[tuple[int, int, int]], mem_type: str):
        """Registers (address, bytes, device id) regions; returns what deregister takes."""
        descs = self._bind.nixlRegDList(self._mems[mem_type],
                                        [(addr, size, dev, "") for addr, size, dev in regions])
        self._agent.registerMem(descs, [self._ucx])
        return descs

    def deregister(self, registered) -> None:
        self._agent.deregisterMem(registered, [self._ucx])

    def metadata(self) -> bytes:
        """Connection info and the registered memory's keys, for a peer's load_peer."""
        return self._agent.getLocalMD()

    def load_peer(self, metadata: bytes) -> str:
        """Loads a peer's metadata; returns its agent name."""
        name = self._agent.loadRemoteMD(metadata)
        return name.decode() if isinstance(name, bytes) else name

    def unload_peer(self, name: str) -> None:
        self._agent.invalidateRemoteMD(name)

    def post_read(self, local_rows, local_mem: str, remote_rows, remote_mem: str, peer: str):
        """Starts local_rows[i] <- remote_rows[i] for every row (address, bytes, device id).
        Returns (transfer, state); the transfer must be released."""
        xfer = self._agent.createXferReq(
            self._bind.NIXL_READ, self._bind.nixlXferDList(self._mems[local_mem], local_rows),
            self._bind.nixlXferDList(self._mems[remote_mem], remote_rows), peer, b"",
            [self._ucx])
        try:
            return xfer, self._state(self._agent.postXferReq(xfer, b""))
        except Exception:
            self.release(xfer)
            raise

    def state(self, xfer) -> str:
        return self._state(self._agent.getXferStatus(xfer))

    def release(self, xfer) -> None:
        """Frees a transfer; an unfinished one is cancelled (raises if it cannot be)."""
        self._agent.releaseXferReq(xfer)

    def _state(self, status) -> str:
        if status == self._bind.NIXL_SUCCESS:
            return "DONE"
        if status == self._bind.NIXL_IN_PROG:
            return "PROC"
        return f"ERR ({status})"
