"""A worker's KV transfer, set up once at start-up from `--kv-transfer` (transport.py says
what each mode offers and takes):

    kv = await start_kv_transfer(mode, kv_caches, layout, ranks)
    kv.transports, kv.cuda_ipc_exporter, kv.nixl_agent, kv.connectors   # what it offers
    kv.blocks, kv.receiver                                              # how it pulls
    kv.close()                                                          # at shutdown

`ranks` (rank_group.RankGroupKV) reaches every rank's share of the cache, one rank or a TP
group alike; which backends run, and how each reaches the ranks, is decided here and nowhere
else, so the worker's server does not branch on mode or TP size.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from tandem.common.kv_exports import cuda_ipc_cache_from_bytes
from tandem.common.kv_layout import KVLayout
from tandem.common.logging import get_logger
from tandem.workers.kv import connectors as registry
from tandem.workers.kv import nixl_backend, transport
from tandem.workers.kv.block_access import KVBlockAccess, kv_block_access
from tandem.workers.kv.block_payload import KVCaches
from tandem.workers.kv.connector import KVConnector, KVConnectorUnavailable
from tandem.workers.kv.receiver import KVReceiver
from tandem.workers.kv.rank_group import RankGroupKV

logger = get_logger(__name__)


@dataclass
class KVTransfer:
    mode: str
    layout: KVLayout
    blocks: KVBlockAccess  # where the grpc backend reads and writes blocks (every rank's)
    receiver: KVReceiver
    transports: list[str]  # offered in this worker's handles, preferred first, grpc last
    cuda_ipc_exporter: object | None = None  # a cuda_ipc.CudaIpcExporter
    nixl_agent: object | None = None  # a NixlKVAgent, or a TP worker's RankGroupNixl
    connectors: dict[str, KVConnector] = field(default_factory=dict)

    def close(self) -> None:
        """Rank 0's one-rank NIXL agent deregisters its cache; every rank's connectors close
        with the executor."""
        if self.nixl_agent is not None:
            self.nixl_agent.close()


async def start_kv_transfer(mode: str, kv_caches: KVCaches, layout: KVLayout,
                            ranks: RankGroupKV) -> KVTransfer:
    """ValueError when the mode cannot work here (a required backend did not start)."""
    device = kv_caches[0][0].device
    transport.check_kv_transfer(mode, device.type)
    blocks = kv_block_access(kv_caches, ranks.tp_size, gather=ranks.gather,
                             scatter=ranks.scatter)
    nixl_agent = await _nixl_agent(mode, kv_caches, ranks, layout)
    offered = transport.offered_transports(mode, device.type,
                                           nixl_ready=nixl_agent is not None)
    exporter = None
    if transport.CUDA_IPC in offered:
        from tandem.workers.kv.cuda_ipc import CudaIpcExporter

        rank_caches = None
        if ranks.tp_size > 1:  # every rank compiles its gather and exports its cache
            rank_caches = [cuda_ipc_cache_from_bytes(data) for data in
                           await ranks.backend(transport.CUDA_IPC).setup(layout)]
        exporter = CudaIpcExporter(kv_caches, layout, rank_caches)
    connectors = await _connectors(mode, device.type, ranks, layout)
    transports = [*offered[:-1], *connectors, transport.GRPC]
    receiver = KVReceiver(mode, layout, blocks, kv_caches, device, ranks.tp_size, nixl_agent,
                          ranks=ranks, connectors=connectors)
    logger.info("KV transfer %s: offering %s", mode, ", ".join(transports))
    return KVTransfer(mode, layout, blocks, receiver, transports, exporter, nixl_agent,
                      connectors)


async def _nixl_agent(mode: str, kv_caches: KVCaches, ranks: RankGroupKV, layout: KVLayout):
    """This worker's NIXL agent over its cache (TP: a nixl_receiver.RankGroupNixl, an agent
    per rank), or None (transport.py says when). In nixl mode a failure stops the worker
    (ValueError); in auto it is logged and nixl is not offered."""
    device_type = kv_caches[0][0].device.type
    if not transport.nixl_wanted(mode, device_type, nixl_backend.is_installed()):
        return None
    try:
        if ranks.tp_size > 1:
            from tandem.workers.kv.nixl_receiver import RankGroupNixl

            return await RankGroupNixl.start(ranks, layout)
        return await asyncio.to_thread(nixl_backend.NixlKVAgent, kv_caches, layout)
    except (nixl_backend.NixlUnavailable, ValueError) as exc:
        if mode == transport.NIXL:
            raise ValueError(f"--kv-transfer nixl: {exc}") from exc
        logger.warning("KV transfer auto: not offering nixl (%s)", exc)
        return None


async def _connectors(mode: str, device_type: str, ranks: RankGroupKV,
                      layout: KVLayout) -> dict[str, KVConnector]:
    """The connector backends this worker runs (connectors.py): the one its mode names, or
    in auto those that want this device. A required one that does not start is a
    ValueError; in auto it is logged and not offered."""
    names = [mode] if mode in registry.connector_backends() else [
        name for name in registry.connector_backends()
        if mode == transport.AUTO and registry.wanted_in_auto(name, device_type)]
    started = {}
    for name in names:
        try:
            started[name] = await KVConnector.start(name, ranks, layout, mode)
        except KVConnectorUnavailable as exc:
            if mode == name:
                raise ValueError(f"--kv-transfer {name}: {exc}") from exc
            logger.warning("KV transfer auto: not offering %s (%s)", name, exc)
    return started
