"""Decode side of the nixl backend: per source, its NIXL agent loaded once; per handle, the
lease and one READ.

    nixl = NixlReceiver(reads, layout, mode)       # worker start-up: OneRankReads(agent), or
                                                   # a TP worker's RankGroupNixl
    num_bytes, failure = await nixl.pull(source, address, handle, block_ids, start_block,
                                         timeout)  # failure: why nixl cannot serve this peer

Per peer (source address): ExportNixlAgent once, load the source's agent once
(`reads.load_peer`: on every rank of a TP worker), reuse it for every handle whose
nixl.export_id matches; a new export_id (the source restarted) unloads the old agent first,
so nothing is ever read through a dead process's addresses. A peer whose agent did not load is
not tried again until its export_id changes (pull returns the failure; auto mode then goes by
grpc).

Per handle (lease rules of kv_transfer_service.py): LeaseKV renews the pin and names the blocks; the
READ covers exactly those blocks, and waits at most until the lease ends; the caller releases
the handle after pull returned. A READ that fails or times out raises KVTransferFailed.
"""
from __future__ import annotations

import asyncio

from tandem.common.kv_exports import KVHandle, NixlAgentExport, to_bytes
from tandem.common.kv_layout import KVLayout
from tandem.common.logging import get_logger
from tandem.workers.kv import transport
from tandem.workers.kv.nixl_backend import NixlKVAgent, NixlPeer, NixlUnavailable
from tandem.workers.kv.nixl_ranks import merge_rank_exports
from tandem.workers.kv.rank_connector import pack_rank_exports
from tandem.workers.kv.source import KVSource, lease_for_read

logger = get_logger(__name__)


class OneRankReads:
    """What NixlReceiver calls, for a one-rank worker: its own agent, on the event loop.
    (A TP worker's equivalent, RankGroupNixl, runs them on every rank.)"""

    def __init__(self, agent: NixlKVAgent) -> None:
        self.agent = agent

    async def load_peer(self, export: NixlAgentExport) -> NixlPeer:
        return self.agent.add_peer(export)

    async def unload_peer(self, peer: NixlPeer) -> None:
        self.agent.remove_peer(peer)

    async def read(self, peer: NixlPeer, src_ids: list[int], dst_ids: list[int],
                   timeout: float) -> int:
        return await self.agent.read_blocks(peer, src_ids, dst_ids, timeout)


class RankGroupNixl:
    """A TP worker's nixl end, on the event loop: what the servicers serve (export, endpoint)
    and what NixlReceiver calls (load_peer, unload_peer, read), each run on every rank by KV
    rank ops (rank_group.RankGroupKV; the ranks' side is nixl_ranks.RankNixl)."""

    def __init__(self, ranks, export: NixlAgentExport) -> None:
        self._ranks = ranks
        self._export = export
        self.tp_size = ranks.tp_size
        self.endpoint = export.endpoint

    @classmethod
    async def start(cls, ranks, layout: KVLayout) -> RankGroupNixl:
        """Creates every rank's agent. Raises NixlUnavailable when one could not be."""
        ranks = ranks.backend(transport.NIXL)
        export = merge_rank_exports(await ranks.setup(layout))
        logger.info("NIXL agents on all %d ranks (rank 0: %s)", len(export.ranks),
                    export.endpoint.agent_name)
        return cls(ranks, export)

    def export(self) -> NixlAgentExport:
        return self._export

    async def load_peer(self, export: NixlAgentExport) -> NixlPeer:
        """Loads a source's rank agents on every rank. NixlUnavailable when any rank could
        not (or the source has another TP size)."""
        if len(export.ranks) != self.tp_size:
            raise NixlUnavailable(f"the source exported {len(export.ranks)} rank agents, "
                                  f"this worker has {self.tp_size} ranks")
        slot, failed = await self._ranks.add_peer(
            pack_rank_exports([to_bytes(rank) for rank in export.ranks]))
        if failed:
            await self._ranks.remove_peer(slot)
            raise NixlUnavailable(f"loading the source's agents failed on rank(s) {failed} "
                                  f"(see their logs)")
        first = export.ranks[0]
        return NixlPeer(first.endpoint.agent_name, export.endpoint.export_id,
                        first.mem_type, list(first.tensors), slot=slot)

    async def unload_peer(self, peer: NixlPeer) -> None:
        await self._ranks.remove_peer(peer.slot)

    async def read(self, peer: NixlPeer, src_ids: list[int], dst_ids: list[int],
                   timeout: float) -> int:
        """Every rank READs its heads of the blocks; returns the bytes read. Engine steps go on
        while it is in flight. KVTransferFailed when a rank failed or `timeout` passed (the
        READ is then cancelled on every rank); a cancelled caller cancels it too."""
        await self._ranks.load(peer.slot, src_ids, dst_ids, timeout,
                               f"NIXL READ of {len(src_ids)} blocks")
        return len(src_ids) * sum(t.block_bytes for t in peer.tensors) * self.tp_size

    def close(self) -> None:
        """Nothing here: every rank's agent closes with the executor's rank connectors."""


class NixlReceiver:
    def __init__(self, reads, layout: KVLayout, mode: str) -> None:
        self.reads = reads  # OneRankReads or nixl_ranks.RankGroupNixl
        self.layout = layout
        self.mode = mode
        self._peers: dict[str, NixlPeer] = {}  # address -> its loaded agent
        self._failed: dict[str, str] = {}  # address -> export_id whose agent did not load
        self._loading: dict[str, asyncio.Lock] = {}  # address -> held while loading its agent

    def loaded(self, address: str) -> NixlPeer | None:
        return self._peers.get(address)

    async def pull(self, source: KVSource, address: str, handle: KVHandle,
                   block_ids: list[int], start_block: int, timeout: float | None
                   ) -> tuple[int, str | None]:
        """(bytes read, None), or (0, why) when the source's agent cannot be loaded. Raises
        what the source's calls raise (grpc.aio.AioRpcError), ValueError or
        transport.KVTransferFailed."""
        peer, failure = await self.peer(source, address, handle, timeout)
        if peer is None:
            return 0, failure
        return await self._read(source, address, peer, handle, block_ids, start_block,
                                timeout), None

    async def peer(self, source: KVSource, address: str, handle: KVHandle,
                   timeout: float | None):
        """(peer, None) with the source's agent loaded, or (None, why it cannot be). The
        first handles from a peer, pulled together, load its agent once."""
        export_id = handle.nixl.export_id if handle.nixl is not None else ""
        if not export_id:
            return None, "the handle offers nixl without an endpoint"
        peer = self._peers.get(address)
        if peer is not None and peer.export_id == export_id:
            return peer, None
        async with self._loading.setdefault(address, asyncio.Lock()):
            return await self._load(source, address, export_id, timeout)

    async def _load(self, source: KVSource, address: str, export_id: str,
                    timeout: float | None):
        peer = self._peers.get(address)
        if peer is not None and peer.export_id == export_id:
            return peer, None  # loaded while this pull waited for the lock
        if self._failed.get(address) == export_id:
            return None, "loading its NIXL agent failed before"
        if peer is not None:  # stale: the source restarted; never read through old metadata
            await self.reads.unload_peer(self._peers.pop(address))
        export = await source.export_nixl(timeout)
        if export.endpoint.export_id != export_id:
            raise ValueError(f"peer {address} exported NIXL agent "
                             f"{export.endpoint.export_id}, the handle names {export_id}: "
                             f"it restarted in between")
        try:
            peer = await self.reads.load_peer(export)
        except NixlUnavailable as exc:
            self._failed[address] = export_id
            log = logger.error if self.mode == transport.NIXL else logger.warning
            log("KV from %s: nixl unavailable (%s)%s", address, exc,
                "" if self.mode == transport.NIXL else "; falling back to grpc")
            return None, str(exc)
        logger.info("KV from %s over nixl: loaded agent %s (%d %s cache tensors%s)", address,
                    peer.agent_name, len(peer.tensors), peer.mem_type,
                    f", on all {len(export.ranks)} ranks" if export.ranks else "")
        self._peers[address] = peer
        return peer, None

    async def _read(self, source, address, peer, handle, block_ids, start_block,
                    timeout) -> int:
        leased = await lease_for_read(source, handle, block_ids, start_block, timeout)
        num_bytes = await self.reads.read(peer, leased.src_ids, list(block_ids),
                                          leased.budget_seconds)
        leased.check_outlasted(handle, f"the NIXL READ from {address}")
        return num_bytes
