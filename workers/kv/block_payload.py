"""KV blocks as byte payloads: what the grpc transfer backend streams between workers.

For each layer and each of K (kv_index 0) and V (1), the payload is the selected blocks'
tensor [num_blocks, block_size, kv_heads, head_dim] as raw bytes, cut into chunks. The sender
reads pinned blocks (nobody writes them while pinned); the receiver writes into blocks it has
allocated and not yet handed to the scheduler, so neither side races the engine's steps.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
DEFAULT_CHUNK_BYTES = 1 << 20  # well under gRPC's 4 MB default message limit


def iter_payload_chunks(kv_caches: KVCaches, block_ids: list[int],
                        chunk_bytes: int = DEFAULT_CHUNK_BYTES
                        ) -> Iterator[tuple[int, int, int, bytes]]:
    """Yields (layer, kv_index, byte offset, data) covering every selected block."""
    if not block_ids:
        return
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0][0].device)
    for layer, pair in enumerate(kv_caches):
        for kv_index, cache in enumerate(pair):
            blocks = cache.index_select(0, index).cpu().contiguous()
            raw = blocks.view(torch.uint8).reshape(-1).numpy()
            for offset in range(0, raw.size, chunk_bytes):
                yield layer, kv_index, offset, raw[offset: offset + chunk_bytes].tobytes()


class PayloadWriter:
    """Assembles received chunks and writes each completed layer's K/V into the given blocks."""

    def __init__(self, kv_caches: KVCaches, block_ids: list[int]) -> None:
        self.kv_caches = kv_caches
        self.block_ids = block_ids
        k_cache = kv_caches[0][0]
        self._index = torch.tensor(block_ids, dtype=torch.long, device=k_cache.device)
        self._block_shape = (len(block_ids), *k_cache.shape[1:])
        itemsize = k_cache.element_size()
        self.payload_bytes = len(block_ids) * k_cache[0].numel() * itemsize
        self._staging: dict[tuple[int, int], torch.Tensor] = {}
        self._received: dict[tuple[int, int], int] = {}
        self.num_bytes = 0

    def write(self, layer: int, kv_index: int, offset: int, data: bytes) -> None:
        if not 0 <= layer < len(self.kv_caches) or kv_index not in (0, 1):
            raise ValueError(f"KV chunk for layer {layer}, kv_index {kv_index} is out of range")
        if offset < 0 or offset + len(data) > self.payload_bytes:
            raise ValueError(f"KV chunk [{offset}, {offset + len(data)}) is outside the "
                             f"{self.payload_bytes}-byte payload of layer {layer}")
        key = (layer, kv_index)
        staging = self._staging.get(key)
        if staging is None:
            staging = self._staging[key] = torch.empty(self.payload_bytes, dtype=torch.uint8)
        staging[offset: offset + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._received[key] = self._received.get(key, 0) + len(data)
        self.num_bytes += len(data)
        if self._received[key] == self.payload_bytes:
            cache = self.kv_caches[layer][kv_index]
            blocks = staging.view(cache.dtype).view(self._block_shape).to(cache.device)
            cache.index_copy_(0, self._index, blocks)
            del self._staging[key]

    def check_complete(self) -> None:
        expected = {(layer, kv) for layer in range(len(self.kv_caches)) for kv in (0, 1)}
        missing = sorted(k for k in expected if self._received.get(k) != self.payload_bytes)
        if self.block_ids and missing:
            raise ValueError(f"KV transfer incomplete: {len(missing)} of {len(expected)} "
                             f"layer payloads missing or short (first: layer {missing[0][0]})")
