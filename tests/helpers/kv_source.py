"""A prefill side for KV transfer tests: seeded CPU caches of each layout kind, pinned
handles, and the real KVTransferServicer (with a NIXL agent) on 127.0.0.1, in its own process.

    source = KVSource.start(kinds=("mha",), handles={"h": [5, 2, 3]})   # spawned process
    source.ports["mha"], source.endpoints["mha"]                         # where, which agent
    source.connector_export_ids["mha"]  # with connector=True: the nixl backend also served
                                        # as a connector (kv/connector.py), this export id
    caches = make_caches("mha", NUM_BLOCKS)  # the same bytes, rebuilt here from the seed
    source.kill()

The engine is bench's PinnedHandlesEngine (the AsyncEngine methods the servicer calls): what
is under test is the transfer seam.
"""
from __future__ import annotations

import asyncio
import multiprocessing
from dataclasses import dataclass, field

import torch

NUM_BLOCKS = 24
BLOCK_SIZE = 4
NUM_LAYERS = 3
SEED = 99


def make_caches(kind: str, num_blocks: int, seed: int | None = SEED
                ) -> list[tuple[torch.Tensor, ...]]:
    """bf16 caches of `kind` as model runners hold them; random bit patterns (NaNs included)
    from `seed`, or zeros when seed is None. "mha" caches are views of one block-major stack
    (one NIXL region, one descriptor per block run); the MLA kinds allocate every tensor
    apart (one region each), and "mla_indexer" mixes widths."""
    widths = {"mha": (8, 8), "mla": (24,), "mla_indexer": (24, 8)}[kind]
    heads = 2 if kind == "mha" else 1
    generator = torch.Generator().manual_seed(seed) if seed is not None else None

    def fill(t: torch.Tensor) -> torch.Tensor:
        if generator is not None:
            t.view(torch.int16).random_(-2**15, 2**15, generator=generator)
        return t

    if kind == "mha":  # block-major, as ModelRunner allocates it
        stack = fill(torch.zeros((num_blocks, NUM_LAYERS * 2, BLOCK_SIZE, heads, widths[0]),
                                 dtype=torch.bfloat16))
        return [(stack[:, 2 * i], stack[:, 2 * i + 1]) for i in range(NUM_LAYERS)]
    return [tuple(fill(torch.zeros((num_blocks, BLOCK_SIZE, heads, w), dtype=torch.bfloat16))
                  for w in widths) for _ in range(NUM_LAYERS)]


class OneRank:
    """A one-rank worker's KV rank ops, run in this thread (as the one-rank executor's
    run_kv_ops runs them on the engine thread)."""

    def __init__(self, rank_kv) -> None:
        self.rank_kv = rank_kv

    async def run_kv_ops(self, ops: list) -> list:
        return self.rank_kv.run(ops, None)

    def submit_kv_ops(self, ops: list) -> None:
        self.rank_kv.run(ops, None)


def _serve(kinds: tuple[str, ...], handles: dict[str, list[int]], queue, stop,
           connector: bool = False) -> None:
    import grpc

    from tandem.bench.kv_transfer_source import PinnedHandlesEngine
    from tandem.common.convert import nixl_endpoint_to_proto
    from tandem.v1 import worker_pb2_grpc
    from tandem.workers.kv.block_access import DirectKVBlocks
    from tandem.workers.kv_transfer_service import KVTransferServicer
    from tandem.common.kv_layout import KVLayout
    from tandem.workers.kv.connector import KVConnector
    from tandem.workers.kv.nixl_backend import NixlKVAgent
    from tandem.workers.kv.rank_group import RankGroupKV
    from tandem.workers.kv.rank_ops import RankKV

    engine = PinnedHandlesEngine(handles)

    async def serve():
        servers, ports, endpoints, export_ids = [], {}, {}, {}
        for kind in kinds:
            caches = make_caches(kind, NUM_BLOCKS)
            layout = KVLayout.from_kv_caches(caches, kind=kind)
            agent, connectors = None, {}
            if connector:
                ranks = RankGroupKV(OneRank(RankKV(caches, torch.device("cpu"), 0, 1)), 1)
                connectors["nixl"] = await KVConnector.start("nixl", ranks, layout, "auto")
                export_ids[kind] = connectors["nixl"].endpoint.export_id
            else:
                agent = NixlKVAgent(caches, layout)
                endpoints[kind] = nixl_endpoint_to_proto(agent.endpoint).SerializeToString()
            server = grpc.aio.server()
            worker_pb2_grpc.add_KVTransferServicer_to_server(
                KVTransferServicer(engine, layout, DirectKVBlocks(caches), None, agent,
                                   connectors), server)
            ports[kind] = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            servers.append(server)
        queue.put((ports, endpoints, export_ids))
        while not stop.is_set():
            await asyncio.sleep(0.05)
        for server in servers:
            await server.stop(0)

    asyncio.run(serve())


@dataclass
class KVSource:
    process: multiprocessing.Process
    stop_event: object
    ports: dict[str, int] = field(default_factory=dict)
    endpoints: dict[str, bytes] = field(default_factory=dict)  # serialized NixlEndpoint
    connector_export_ids: dict[str, str] = field(default_factory=dict)

    @classmethod
    def start(cls, kinds: tuple[str, ...], handles: dict[str, list[int]],
              connector: bool = False) -> KVSource:
        ctx = multiprocessing.get_context("spawn")
        queue, stop = ctx.Queue(), ctx.Event()
        process = ctx.Process(target=_serve, args=(kinds, handles, queue, stop, connector),
                              daemon=True)
        process.start()
        try:
            ports, endpoints, export_ids = queue.get(timeout=120)
        except Exception:
            process.kill()
            raise
        return cls(process, stop, ports, endpoints, export_ids)

    def address(self, kind: str) -> str:
        return f"127.0.0.1:{self.ports[kind]}"

    def stop(self) -> None:
        self.stop_event.set()
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)
