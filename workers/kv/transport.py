"""Which KV transfer backend a handle travels by: `--kv-transfer auto|grpc|cuda-ipc|nixl`, or a
connector backend (connectors.py, e.g. mori).

Prefill side: every handle offers "grpc"; it also offers
  "cuda-ipc" (with the host identity, device and export id in KVHandle.cuda_ipc) when the mode
             is auto or cuda-ipc and the cache is on a CUDA device; under TP every rank's
             cache is exported (rank r of the receiver copies from rank r of the source:
             ipc_ranks.py);
  "nixl"     (with the NIXL agent's name and export id in KVHandle.nixl) when this worker
             created a NIXL agent over its cache: always in nixl mode, and in auto mode when
             nixl is installed and the cache is on a CUDA device. Under TP every rank has an
             agent over its heads (rank r of the receiver READs from rank r of the source:
             nixl_ranks.py). auto leaves CPU workers on grpc: a host cache gains
             little from NIXL, and the default CPU path stays the one every test exercises.

Decode side, per handle (after the layout check, which refuses a mismatch either way):
  grpc      always grpc.
  auto      cuda-ipc when the handle offers it, the source is on this host, this worker's cache
            is on CUDA devices, and mapping the source's cache succeeds (on every rank); else
            nixl when the handle offers it, this worker has a NIXL agent and loading the
            source's agent succeeds; otherwise grpc, with one log line per peer.
  cuda-ipc  as auto without nixl, but a handle that cannot go by cuda-ipc fails the request
            with the reason instead of falling back (a deployment that asked for it wants to
            know).
  nixl      nixl only (also on one host): a handle that cannot go by nixl fails the request
            with the reason.
  <connector> (a backend of connectors.py, e.g. mori) that backend only, on any host: a
            handle that cannot go by it fails the request with the reason. auto takes a
            connector backend when the handle offers it, this worker runs it (the backend
            wants the device: mori on ROCm) and cuda-ipc and nixl did not serve; before grpc.
A transfer that fails once begun (a READ error, a timeout) fails the request in every mode: its
blocks may be half written, and the caller aborts it with UNAVAILABLE naming the peer.
"""
from __future__ import annotations

from tandem.workers.kv import connectors

AUTO = "auto"
GRPC = "grpc"
CUDA_IPC = "cuda-ipc"
NIXL = "nixl"
KV_TRANSFER_MODES = (AUTO, GRPC, CUDA_IPC, NIXL, *connectors.connector_backends())


class KVTransportUnavailable(RuntimeError):
    """The handle cannot travel by the backend this worker requires."""


class KVTransferFailed(RuntimeError):
    """A transfer began and did not complete (error or timeout); the blocks it was writing
    hold unknown bytes."""


def check_kv_transfer(mode: str, device_type: str) -> None:
    """Validates `--kv-transfer` against the worker's device (ValueError)."""
    if mode not in KV_TRANSFER_MODES:
        raise ValueError(f"--kv-transfer {mode!r} is not one of {', '.join(KV_TRANSFER_MODES)}")
    if mode == CUDA_IPC and device_type != "cuda":
        raise ValueError(f"--kv-transfer cuda-ipc needs the KV cache on a CUDA device, not "
                         f"{device_type!r} (use auto or grpc)")
    if mode in connectors.connector_backends():
        why = connectors.unavailable_reason(mode)
        if why is not None:
            raise ValueError(f"--kv-transfer {mode}: {why} (use auto or grpc)")


def cuda_ipc_possible(mode: str, device_type: str) -> bool:
    return mode in (AUTO, CUDA_IPC) and device_type == "cuda"


def nixl_wanted(mode: str, device_type: str, nixl_installed: bool) -> bool:
    """Whether this worker should create NIXL agents over its cache (module docstring)."""
    if mode == NIXL:
        return True
    return mode == AUTO and device_type == "cuda" and nixl_installed


def offered_transports(mode: str, device_type: str, nixl_ready: bool = False) -> list[str]:
    """What a prefill worker offers in its handles, preferred first, grpc last.
    nixl_ready: this worker has a NIXL agent over its cache."""
    offered = [CUDA_IPC] if cuda_ipc_possible(mode, device_type) else []
    if nixl_ready and mode in (AUTO, NIXL):
        offered.append(NIXL)
    return [*offered, GRPC]


def choose_transport(mode: str, transports: list[str], source_host_id: str,
                     local_host_id: str, device_type: str,
                     nixl_ready: bool = False) -> tuple[str, str]:
    """(backend, why) for one handle on the decode side, before trying to map anything.
    nixl_ready: this worker has a NIXL agent over its cache. Raises KVTransportUnavailable
    when mode is cuda-ipc or nixl and the handle cannot use it, or when nothing is common."""
    offered = transports or [GRPC]
    if mode == GRPC:
        return GRPC, "--kv-transfer grpc"
    refusals = []
    if mode in (AUTO, CUDA_IPC):
        why = _cuda_ipc_refusal(offered, source_host_id, local_host_id, device_type)
        if why is None:
            return CUDA_IPC, "same host"
        if mode == CUDA_IPC:
            raise KVTransportUnavailable(f"--kv-transfer cuda-ipc: {why}")
        refusals.append(why)
    if mode in (AUTO, NIXL):
        if NIXL not in offered:
            why = "the source does not offer nixl"
        elif not nixl_ready:
            why = "this worker has no NIXL agent"
        else:
            return NIXL, "; ".join(refusals) or "--kv-transfer nixl"
        if mode == NIXL:
            raise KVTransportUnavailable(f"--kv-transfer nixl: {why}")
        refusals.append(why)
    why = "; ".join(refusals)
    if GRPC not in offered:
        raise KVTransportUnavailable(f"no common KV transfer backend: source offers "
                                     f"{offered}, {why}")
    return GRPC, why


def _cuda_ipc_refusal(offered: list[str], source_host_id: str, local_host_id: str,
                      device_type: str) -> str | None:
    if CUDA_IPC not in offered:
        return "the source does not offer cuda-ipc"
    if not source_host_id or source_host_id != local_host_id:
        return f"the source is on another host ({source_host_id or 'unknown'})"
    if device_type != "cuda":
        return f"this worker's KV cache is not on a CUDA device ({device_type})"
    return None
