"""KV blocks as byte payloads: what the grpc transfer backend streams between workers.

A layer's cache is a tuple of tensors (MHA: K at index 0, V at 1; MLA: the latent at 0; sparse
MLA: the latent at 0, the indexer keys at 1; see layout.py). For each layer and each tensor
index, the payload is the selected blocks of that tensor, [num_blocks, block_size, ...], as raw
bytes cut into chunks. The sender reads pinned blocks (nobody writes them while pinned); the
receiver writes into blocks it has allocated and not yet handed to the scheduler, so neither
side races the engine's steps.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

KVCaches = list[tuple[torch.Tensor, ...]]
DEFAULT_CHUNK_BYTES = 1 << 20  # well under gRPC's 4 MB default message limit


def iter_payload_chunks(kv_caches: KVCaches, block_ids: list[int],
                        chunk_bytes: int = DEFAULT_CHUNK_BYTES
                        ) -> Iterator[tuple[int, int, int, bytes]]:
    """Yields (layer, tensor index, byte offset, data) covering every selected block."""
    if not block_ids:
        return
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0][0].device)
    for layer, caches in enumerate(kv_caches):
        for kv_index, cache in enumerate(caches):
            blocks = cache.index_select(0, index).cpu().contiguous()
            raw = blocks.view(torch.uint8).reshape(-1).numpy()
            for offset in range(0, raw.size, chunk_bytes):
                yield layer, kv_index, offset, raw[offset: offset + chunk_bytes].tobytes()


class PayloadWriter:
    """Assembles received chunks and writes each completed (layer, tensor) payload into the
    given blocks."""

    def __init__(self, kv_caches: KVCaches, block_ids: list[int]) -> None:
        self.kv_caches = kv_caches
        self.block_ids = block_ids
        self._index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0][0].device)
        # (layer, tensor index) -> bytes of its payload: the selected blocks of that tensor.
        self._payload_bytes = {
            (layer, kv_index): len(block_ids) * cache[0].numel() * cache.element_size()
            for layer, caches in enumerate(kv_caches) for kv_index, cache in enumerate(caches)}
        self._staging: dict[tuple[int, int], torch.Tensor] = {}
        self._received: dict[tuple[int, int], int] = {}
        self.num_bytes = 0

    def write(self, layer: int, kv_index: int, offset: int, data: bytes) -> None:
        key = (layer, kv_index)
        payload_bytes = self._payload_bytes.get(key)
        if payload_bytes is None:
            raise ValueError(f"KV chunk for layer {layer}, kv_index {kv_index} is out of range")
        if offset < 0 or offset + len(data) > payload_bytes:
            raise ValueError(f"KV chunk [{offset}, {offset + len(data)}) is outside the "
                             f"{payload_bytes}-byte payload of layer {layer}, "
                             f"kv_index {kv_index}")
        staging = self._staging.get(key)
        if staging is None:
            staging = self._staging[key] = torch.empty(payload_bytes, dtype=torch.uint8)
        staging[offset: offset + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._received[key] = self._received.get(key, 0) + len(data)
        self.num_bytes += len(data)
        if self._received[key] == payload_bytes:
            cache = self.kv_caches[layer][kv_index]
            blocks = staging.view(cache.dtype).view(len(self.block_ids), *cache.shape[1:])
            cache.index_copy_(0, self._index, blocks.to(cache.device))
            del self._staging[key]

    def check_complete(self) -> None:
        missing = sorted(key for key, size in self._payload_bytes.items()
                         if self._received.get(key) != size)
        if self.block_ids and missing:
            layer, kv_index = missing[0]
            raise ValueError(f"KV transfer incomplete: {len(missing)} of "
                             f"{len(self._payload_bytes)} payloads missing or short (first: "
                             f"layer {layer}, kv_index {kv_index})")
