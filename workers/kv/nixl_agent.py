"""One NIXL agent with its UCX backend: the few NIXL calls the nixl KV backend makes.

    agent = NixlAgent(name, cuda_device)                     # UCX backend, progress thread
    registered = agent.register([(address, bytes, device_id)], "DRAM" | "VRAM")
    agent.metadata() -> bytes        peer = agent.load_peer(metadata)   agent.unload_peer(peer)
    future = agent.start_read(local_rows, "DRAM", remote_rows, "VRAM", peer, timeout,
                              cancelled, what)           # [N, 3] uint64 rows; a whole READ
    agent.close()                                        # after deregistering

Built on NIXL's bindings (the module under nixl._api) rather than nixl._api.nixl_agent, for
one reason: nixl_agent starts NIXL's progress thread with a delay of 0 us, and that thread
then spins a whole core per agent even when idle (nixl-cu13 1.5.1). With PROGRESS_DELAY_US
it costs a few percent of a core and READs are as fast. The thread cannot be left off: a READ
completes only while the *source* agent makes progress (over UCX's tcp transport the source
answers every get; over shared memory the connection set-up needs it too; without it a READ
stays in progress forever).

Every NIXL call is made on the agent's own thread (so NIXL_THREAD_SYNC_NONE is safe), and a
READ runs there from post to release. Callers never wait on it unless they ask to: on one host
UCX does the whole READ inside the post call (postXferReq then reports it done; tens of
milliseconds for a TP rank's share of a long prompt's cache), and that call releases the GIL,
so the engine steps and the event loop serves streams meanwhile (bench/RESULTS.md,
nixl_read_anatomy).
"""
from __future__ import annotations

import concurrent.futures
import importlib
import importlib.util
import threading
import time

from tandem.common.logging import get_logger
from tandem.common.polling import poll_delays
from tandem.workers.kv.transport import KVTransferFailed

# The meta package `nixl` picks the wheel matching the CUDA it detects; `tandem[nixl]`
# installs nixl-cu13 alone, which imports as nixl_cu13.
_PACKAGES = ("nixl", "nixl_cu13", "nixl_cu12")
PROGRESS_DELAY_US = 100  # the progress thread's sleep when it found nothing to progress
MEM_TYPES = ("DRAM", "VRAM")
logger = get_logger(__name__)


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
    """The agent and the one thread that makes its calls (CUDA device `cuda_device` current
    there when given, for UCX's CUDA calls)."""

    def __init__(self, name: str, cuda_device: int | None = None) -> None:
        self._thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="nixl", initializer=_use_device, initargs=(cuda_device,))
        self.name = name
        try:
            self._call(self._create)
        except BaseException:
            self._thread.shutdown(wait=False)
            raise

    def _call(self, fn, *args):
        """fn(*args) on the agent's thread; waits for it."""
        return self._thread.submit(fn, *args).result()

    def _create(self) -> None:
        bind = self._bind = _load_bindings()
        config = bind.nixlAgentConfig()
        config.useProgThread = True
        config.pthrDelay = PROGRESS_DELAY_US
        config.useListenThread = False  # metadata travels over Tandem's own gRPC
        config.syncMode = bind.NIXL_THREAD_SYNC_NONE
        config.captureTelemetry = False
        try:
            self._agent = bind.nixlAgent(self.name, config)
        except Exception as exc:  # NIXL raises its own exception types
            raise NixlUnavailable(f"creating NIXL agent {self.name} failed: {exc}") from exc
        plugins = self._agent.getAvailPlugins()
        if "UCX" not in plugins:
            raise NixlUnavailable(f"NIXL has no UCX plugin (plugins: {plugins})")
        try:
            self._ucx = self._agent.createBackend("UCX", {})
        except Exception as exc:  # e.g. UCX_TLS naming no usable transport
            raise NixlUnavailable(f"NIXL's UCX backend did not start: {exc} (check UCX_TLS "
                                  f"and UCX_NET_DEVICES)") from exc
        self._mems = {"DRAM": bind.DRAM_SEG, "VRAM": bind.VRAM_SEG}

    def register(self, regions: list[tuple[int, int, int]], mem_type: str):
        """Registers (address, bytes, device id) regions; returns what deregister takes."""
        def register():
            descs = self._bind.nixlRegDList(
                self._mems[mem_type], [(addr, size, dev, "") for addr, size, dev in regions])
            self._agent.registerMem(descs, [self._ucx])
            return descs
        return self._call(register)

    def deregister(self, registered) -> None:
        self._call(self._agent.deregisterMem, registered, [self._ucx])

    def metadata(self) -> bytes:
        """Connection info and the registered memory's keys, for a peer's load_peer."""
        return self._call(self._agent.getLocalMD)

    def load_peer(self, metadata: bytes) -> str:
        """Loads a peer's metadata; returns its agent name."""
        name = self._call(self._agent.loadRemoteMD, metadata)
        return name.decode() if isinstance(name, bytes) else name

    def unload_peer(self, name: str) -> None:
        self._call(self._agent.invalidateRemoteMD, name)

    def start_read(self, local_rows, local_mem: str, remote_rows, remote_mem: str, peer: str,
                   timeout: float, cancelled: threading.Event,
                   what: str) -> concurrent.futures.Future:
        """Queues local_rows[i] <- remote_rows[i] for every row (address, bytes, device id)
        on the agent's thread: post, poll until done, release. The future's result is None
        once the READ is done; it raises KVTransferFailed when NIXL failed it, when it
        outlasted `timeout` seconds or when `cancelled` was set (an unfinished transfer is
        cancelled by its release, so no byte lands after the future is over)."""
        return self._thread.submit(self._read, local_rows, local_mem, remote_rows,
                                   remote_mem, peer, time.monotonic() + timeout, cancelled,
                                   what)

    def _read(self, local_rows, local_mem, remote_rows, remote_mem, peer, deadline,
              cancelled, what) -> None:
        if cancelled.is_set():
            raise KVTransferFailed(f"{what}: cancelled before it started")
        xfer = None
        try:
            xfer = self._agent.createXferReq(
                self._bind.NIXL_READ, self._bind.nixlXferDList(self._mems[local_mem],
                                                               local_rows),
                self._bind.nixlXferDList(self._mems[remote_mem], remote_rows), peer, b"",
                [self._ucx])
            state = self._state(self._agent.postXferReq(xfer, b""))
            delays = poll_delays()
            while state == "PROC":
                if cancelled.is_set():
                    raise KVTransferFailed(f"{what}: cancelled")
                if time.monotonic() > deadline:
                    raise KVTransferFailed(f"{what}: not done in time")
                time.sleep(next(delays))
                state = self._state(self._agent.getXferStatus(xfer))
            if state != "DONE":
                raise KVTransferFailed(f"{what}: NIXL reports {state}")
        except KVTransferFailed:
            raise
        except Exception as exc:  # NIXL's errors: unknown agent, bad descriptors, ...
            raise KVTransferFailed(f"{what}: {type(exc).__name__}: {exc}") from exc
        finally:
            if xfer is not None:
                try:
                    self._agent.releaseXferReq(xfer)
                except Exception as exc:
                    logger.error("%s: releasing the transfer failed (%s); its blocks may "
                                 "still be written", what, exc)

    def _state(self, status) -> str:
        if status == self._bind.NIXL_SUCCESS:
            return "DONE"
        if status == self._bind.NIXL_IN_PROG:
            return "PROC"
        return f"ERR ({status})"

    def close(self) -> None:
        """Stops the agent's thread once what was queued there has run."""
        self._thread.shutdown(wait=True)


def _use_device(cuda_device: int | None) -> None:
    if cuda_device is not None:
        import torch

        torch.cuda.set_device(cuda_device)
