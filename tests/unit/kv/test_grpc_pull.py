"""The grpc KV backend's wire format, through a real KVTransferServicer on 127.0.0.1: small
handles arrive in a few responses (several tensors' chunks packed together, each response under
DEFAULT_CHUNK_BYTES), and a reader of the raw stream and pull_kv rebuild the same blocks bit for
bit."""
from __future__ import annotations

import asyncio

import grpc
import torch

from tandem.bench.kv_transfer_source import PinnedHandlesEngine
from tandem.common.convert import layout_to_proto
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem.workers.kv.block_access import DirectKVBlocks
from tandem.workers.kv.block_payload import DEFAULT_CHUNK_BYTES, PayloadWriter
from tandem.workers.kv_transfer_service import KVTransferServicer, pull_kv
from tandem.common.kv_layout import KVLayout

LAYERS, BLOCKS, BLOCK_SHAPE = 6, 12, (16, 2, 64)  # 4 KiB blocks (bf16)


def caches(seed: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    out = []
    for _ in range(LAYERS):
        pair = []
        for _ in range(2):
            t = torch.zeros((BLOCKS, *BLOCK_SHAPE), dtype=torch.bfloat16)
            if gen is not None:
                t.view(torch.int16).random_(-2**15, 2**15, generator=gen)  # NaNs included
            pair.append(t)
        out.append(tuple(pair))
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def test_pull_wire_has_one_format():
    """PullKV has one response format: packed pieces. The per-chunk fields and the request's
    accepts_pieces switch are reserved, so their numbers are never reused."""
    request = worker_pb2.PullKVRequest.DESCRIPTOR
    response = worker_pb2.PullKVResponse.DESCRIPTOR
    assert "accepts_pieces" not in request.fields_by_name
    assert 4 not in request.fields_by_number
    assert list(response.fields_by_name) == ["pieces"]


def test_pull_packs_pieces():
    source = caches(seed=5)
    layout = KVLayout.from_kv_caches(source)
    src_ids, dst_ids = [9, 0, 4], [1, 11, 6]

    async def run():
        server = grpc.aio.server()
        worker_pb2_grpc.add_KVTransferServicer_to_server(
            KVTransferServicer(PinnedHandlesEngine({"h": src_ids}), layout,
                               DirectKVBlocks(source)), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                request = worker_pb2.PullKVRequest(
                    handle_id="h", expected_layout=layout_to_proto(layout))
                receiver = caches(seed=None)
                writer = PayloadWriter(receiver, dst_ids)
                responses = 0
                async for r in worker_pb2_grpc.KVTransferStub(channel).PullKV(request):
                    responses += 1
                    assert sum(len(p.data) for p in r.pieces) <= DEFAULT_CHUNK_BYTES
                    for p in r.pieces:
                        writer.write(p.layer, p.kv_index, p.offset, p.data)
                writer.check_complete()
                # pull_kv rebuilds the same blocks
                again = caches(seed=None)
                handle = worker_pb2.KVHandle(handle_id="h", num_blocks=len(src_ids))
                num_bytes = await pull_kv(channel, handle, layout, DirectKVBlocks(again),
                                          dst_ids, 0, timeout=30)
        finally:
            await server.stop(0)
        return receiver, again, responses, num_bytes

    receiver, again, responses, num_bytes = asyncio.run(run())
    assert responses == 1  # 12 chunks of 12 KiB in one response
    assert num_bytes == 2 * LAYERS * len(src_ids) * 4096
    for got in (receiver, again):
        for src_layer, dst_layer in zip(source, got):
            for s, d in zip(src_layer, dst_layer):
                assert same_bytes(d[dst_ids], s[src_ids])
                assert not d[[2, 3]].view(torch.int16).any()  # other blocks untouched
