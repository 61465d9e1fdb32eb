"""The scheduler-side half of a connector backend: rank 0's event-loop end of the backend's
worker-side halves (rank_connector.RankConnector, one per rank), for any backend registered in
connectors.py that has no end of its own (cuda-ipc and nixl have theirs: receiver.py,
nixl_receiver.py).

    connector = await KVConnector.start(name, ranks, layout, mode)   # worker start-up
    connector.endpoint                  # what handles carry (KVHandle.connectors[name])
    connector.export()                  # served to peers (ExportConnector)
    num_bytes, failure = await connector.pull(source, address, handle, block_ids,
                                              start_block, timeout)

Every call reaches the ranks as KV rank ops (rank_group.RankBackend), so one rank and a TP
group go the same way: rank r of the receiver opens rank r of the source, and reads its heads.

Per peer (source address): ExportConnector once, open it on every rank once, and reuse it for
every handle whose endpoint's export_id matches; a new export_id (the source restarted)
removes the old one first, so nothing is read through a dead process's registration. A peer
that could not be opened is not tried again until its export_id changes (pull returns the
failure; auto mode then goes by grpc).

Per handle (lease rules of kv_transfer_service.py): LeaseKV renews the pin and names the
blocks; the load covers exactly those blocks and lasts at most until the lease ends; the caller
releases the handle after pull returned. A load that fails or times out raises
KVTransferFailed (its blocks may be half written).
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from tandem.common.kv_exports import ConnectorEndpoint, ConnectorExport, KVHandle
from tandem.common.kv_layout import KVLayout
from tandem.common.logging import get_logger
from tandem.workers.kv.rank_connector import pack_rank_exports
from tandem.workers.kv.source import KVSource, lease_for_read

logger = get_logger(__name__)


class KVConnectorUnavailable(RuntimeError):
    """The backend cannot run on this worker (not installed, a rank refused its cache)."""


@dataclass
class _Peer:
    export_id: str
    slot: int


class KVConnector:
    def __init__(self, name: str, ranks, export: ConnectorExport, layout: KVLayout,
                 mode: str) -> None:
        self.name = name
        self.layout = layout
        self.mode = mode
        self.endpoint = ConnectorEndpoint(export.export_id)
        self._ranks = ranks  # rank_group.RankBackend of this backend
        self._export = export
        self._peers: dict[str, _Peer] = {}  # address -> the source opened on every rank
        self._failed: dict[str, str] = {}  # address -> export_id that could not be opened
        self._opening: dict[str, asyncio.Lock] = {}  # address -> held while opening it

    @classmethod
    async def start(cls, name: str, ranks, layout: KVLayout, mode: str) -> KVConnector:
        """Every rank registers its cache with the backend. KVConnectorUnavailable naming the
        ranks that could not."""
        backend = ranks.backend(name)
        exports = await backend.setup(layout)
        failed = [rank for rank, data in enumerate(exports) if not data]
        if failed:
            raise KVConnectorUnavailable(f"{name}: no connector on rank(s) {failed} (see "
                                         f"their logs)")
        logger.info("KV connector %s on all %d rank(s)", name, len(exports))
        return cls(name, backend, ConnectorExport(uuid.uuid4().hex, tuple(exports)), layout,
                   mode)

    def export(self) -> ConnectorExport:
        return self._export

    async def pull(self, source: KVSource, address: str, handle: KVHandle,
                   block_ids: list[int], start_block: int, timeout: float | None
                   ) -> tuple[int, str | None]:
        """(bytes loaded, None), or (0, why) when the source cannot be opened. Raises what
        the source's calls raise (grpc.aio.AioRpcError), ValueError or KVTransferFailed."""
        endpoint = handle.connectors.get(self.name)
        if endpoint is None or not endpoint.export_id:
            return 0, f"the handle offers {self.name} without an endpoint"
        peer = self._peers.get(address)
        if peer is None or peer.export_id != endpoint.export_id:
            async with self._opening.setdefault(address, asyncio.Lock()):
                peer, failure = await self._open(source, address, endpoint.export_id, timeout)
            if peer is None:
                return 0, failure
        return await self._load(source, address, peer, handle, block_ids, start_block,
                                timeout), None

    async def _open(self, source: KVSource, address: str, export_id: str,
                    timeout: float | None) -> tuple[_Peer | None, str | None]:
        peer = self._peers.get(address)
        if peer is not None and peer.export_id == export_id:
            return peer, None  # opened while this pull waited for the lock
        if self._failed.get(address) == export_id:
            return None, f"opening its {self.name} export failed before"
        if peer is not None:  # stale: the source restarted; never read through it again
            await self._ranks.remove_peer(self._peers.pop(address).slot)
        export = await source.export_connector(self.name, timeout)
        if export.export_id != export_id:
            raise ValueError(f"peer {address} exported {self.name} {export.export_id}, the "
                             f"handle names {export_id}: it restarted in between")
        if len(export.ranks) != self._ranks.tp_size:
            failure = (f"the source exported {len(export.ranks)} rank(s), this worker has "
                       f"{self._ranks.tp_size}")
            failed = [-1]
        else:
            slot, failed = await self._ranks.add_peer(pack_rank_exports(export.ranks))
            failure = f"opening it failed on rank(s) {failed} (see their logs)"
            if failed:
                await self._ranks.remove_peer(slot)
        if failed:
            self._failed[address] = export_id
            log = logger.error if self.mode == self.name else logger.warning
            log("KV from %s: %s unavailable (%s)", address, self.name, failure)
            return None, failure
        logger.info("KV from %s over %s: opened on %d rank(s)", address, self.name,
                    self._ranks.tp_size)
        peer = self._peers[address] = _Peer(export_id, slot)
        return peer, None

    async def _load(self, source, address, peer, handle, block_ids, start_block,
                    timeout) -> int:
        leased = await lease_for_read(source, handle, block_ids, start_block, timeout)
        src_ids = leased.src_ids
        await self._ranks.load(peer.slot, src_ids, list(block_ids), leased.budget_seconds,
                               f"{self.name} load of {len(src_ids)} blocks")
        leased.check_outlasted(handle, f"the {self.name} load from {address}")
        return len(src_ids) * self.layout.num_layers * self.layout.bytes_per_layer_block \
            * self._ranks.tp_size

    def close(self) -> None:
        """Nothing here: every rank's half closes with the executor."""
