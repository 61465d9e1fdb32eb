"""Which module implements each KV transfer backend, by the name `--kv-transfer` uses.

A backend is one module, imported only when that backend is used (so its library is needed
only there), that defines

    RANK_CONNECTOR                     its worker-side half on every rank (rank_connector.py)
    unavailable_reason() -> str|None   why it cannot run on this machine (None: it can)
    wanted_in_auto(device_type) -> bool   whether `--kv-transfer auto` runs it here

and nothing else: rank 0's side of it is connector.KVConnector, which reaches the ranks through
the step broadcast (rank_ops.py), offers the backend in handles (KVHandle.connectors) and
serves its export (ExportConnector). Adding a backend is such a module and a line here.
cuda-ipc and nixl keep rank 0 sides of their own (receiver.py, nixl_receiver.py: a one-rank
worker copies and READs on its event loop without the engine thread) and need only
RANK_CONNECTOR here, for their TP ranks.
"""
from __future__ import annotations

import importlib

BACKENDS = {
    "cuda-ipc": "tandem.workers.kv.ipc_ranks",
    "nixl": "tandem.workers.kv.nixl_ranks",
    "mori": "tandem.workers.kv.mori_connector",
}
BUILT_IN = ("cuda-ipc", "nixl")  # rank 0's side of their own (module docstring)


def connector_backends() -> list[str]:
    """The backends served by connector.KVConnector (every one but the built-in)."""
    return [name for name in BACKENDS if name not in BUILT_IN]


def backend_module(name: str):
    """The module of backend `name` (ValueError naming the known ones)."""
    path = BACKENDS.get(name)
    if path is None:
        raise ValueError(f"no KV transfer backend {name!r} (known: {', '.join(BACKENDS)})")
    return importlib.import_module(path)


def rank_connector_class(name: str):
    """The worker-side half (rank_connector.RankConnector) of backend `name`."""
    return backend_module(name).RANK_CONNECTOR


def unavailable_reason(name: str) -> str | None:
    """Why connector backend `name` cannot run on this machine (None: it can)."""
    return backend_module(name).unavailable_reason()


def wanted_in_auto(name: str, device_type: str) -> bool:
    module = backend_module(name)
    return module.unavailable_reason() is None and module.wanted_in_auto(device_type)
