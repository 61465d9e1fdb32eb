"""Which KV transfer backend a handle travels by: `--kv-transfer auto|grpc|cuda-ipc`.

Prefill side: every handle offers "grpc"; it also offers "cuda-ipc" (with the host identity,
device and export id in KVHandle.cuda_ipc) when the mode is not "grpc", the cache is on a CUDA
device and the worker runs one rank (TP ranks keep their shares on separate GPUs; a TP group
hands off over grpc, which gathers the ranks' heads).

Decode side, per handle (after the layout check, which refuses a mismatch either way):
  grpc      always grpc.
  auto      cuda-ipc when the handle offers it, the source is on this host, this worker is one
            CUDA rank, and mapping the source's cache succeeds; otherwise grpc, with a log line.
  cuda-ipc  as auto, but a handle that cannot go by cuda-ipc fails the request with the reason
            instead of falling back (a deployment that asked for it wants to know).
"""
from __future__ import annotations

GRPC = "grpc"
CUDA_IPC = "cuda-ipc"
KV_TRANSFER_MODES = ("auto", GRPC, CUDA_IPC)


class KVTransportUnavailable(RuntimeError):
    """The handle cannot travel by the backend this worker requires."""


def check_kv_transfer(mode: str, device_type: str, tp_size: int) -> None:
    """Validates `--kv-transfer` against the worker's device and TP size (ValueError)."""
    if mode not in KV_TRANSFER_MODES:
        raise ValueError(f"--kv-transfer {mode!r} is not one of {', '.join(KV_TRANSFER_MODES)}")
    if mode == CUDA_IPC and device_type != "cuda":
        raise ValueError(f"--kv-transfer cuda-ipc needs the KV cache on a CUDA device, not "
                         f"{device_type!r} (use auto or grpc)")
    if mode == CUDA_IPC and tp_size != 1:
        raise ValueError(f"--kv-transfer cuda-ipc needs --tensor-parallel-size 1 (got "
                         f"{tp_size}); TP workers hand KV off over grpc")


def cuda_ipc_possible(mode: str, device_type: str, tp_size: int) -> bool:
    return mode != GRPC and device_type == "cuda" and tp_size == 1


def offered_transports(mode: str, device_type: str, tp_size: int) -> list[str]:
    """What a prefill worker offers in its handles, preferred last-resort last."""
    if cuda_ipc_possible(mode, device_type, tp_size):
        return [CUDA_IPC, GRPC]
    return [GRPC]


def choose_transport(mode: str, transports: list[str], source_host_id: str,
                     local_host_id: str, device_type: str, tp_size: int) -> tuple[str, str]:
    """(backend, why) for one handle on the decode side, before trying to map anything.
    Raises KVTransportUnavailable when mode is cuda-ipc and the handle cannot use it."""
    offered = transports or [GRPC]
    if mode == GRPC:
        return GRPC, "--kv-transfer grpc"
    if CUDA_IPC not in offered:
        why = "the source does not offer cuda-ipc"
    elif not source_host_id or source_host_id != local_host_id:
        why = f"the source is on another host ({source_host_id or 'unknown'})"
    elif not cuda_ipc_possible(mode, device_type, tp_size):
        why = f"this worker is not one CUDA rank (device {device_type}, TP {tp_size})"
    else:
        return CUDA_IPC, "same host"
    if mode == CUDA_IPC:
        raise KVTransportUnavailable(f"--kv-transfer cuda-ipc: {why}")
    if GRPC not in offered:
        raise KVTransportUnavailable(f"no common KV transfer backend: source offers "
                                     f"{offered}, {why}")
    return GRPC, why
