"""KV blocks as byte payloads: what the grpc transfer backend streams between workers.

A layer's cache is a tuple of tensors (MHA: K at index 0, V at 1; MLA: the latent at 0; sparse
MLA: the latent at 0, the indexer keys at 1; see common/kv_layout.py). For each layer and each
tensor index, the payload is the selected blocks of that tensor, [num_blocks, block_size, ...],
as raw bytes cut into chunks. The sender reads pinned blocks (nobody writes them while pinned); the
receiver writes into blocks it has allocated and not yet handed to the scheduler, so neither
side races the engine's steps.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterator

import torch

KVCaches = list[tuple[torch.Tensor, ...]]
DEFAULT_CHUNK_BYTES = 1 << 20  # well under gRPC's 4 MB default message limit
MAX_CHUNK_BYTES = 3 << 20  # a chunk grows to one whole block only up to this size


def _read_only_bytes(data: bytes) -> torch.Tensor:
    """A uint8 view of received bytes without copying them (only ever read from)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given buffer is not writable"
        return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(
            0, dtype=torch.uint8)


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
            # Whole blocks per chunk where one fits, so the receiver writes them in place.
            block_bytes = raw.size // len(block_ids)
            step = max(1, chunk_bytes // block_bytes) * block_bytes
            step = step if step <= max(chunk_bytes, MAX_CHUNK_BYTES) else chunk_bytes
            for offset in range(0, raw.size, step):
                yield layer, kv_index, offset, raw[offset: offset + step].tobytes()


class PayloadWriter:
    """Writes received chunks into the given blocks as they arrive.

    Chunk bytes that cover whole blocks of a payload are copied straight into the cache (one
    index_copy_ per chunk; iter_payload_chunks cuts chunks at block boundaries); a block that
    arrives in pieces is assembled in a block-sized buffer first. Invariant: a block of the
    cache is written only with a complete block of received bytes."""

    def __init__(self, kv_caches: KVCaches, block_ids: list[int]) -> None:
        self.kv_caches = kv_caches
        self.block_ids = block_ids
        self._index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0][0].device)
        # (layer, tensor index) -> bytes of one block of that tensor; its payload is
        # len(block_ids) of them, in block_ids order.
        self._block_bytes = {
            (layer, kv_index): cache[0].numel() * cache.element_size()
            for layer, caches in enumerate(kv_caches) for kv_index, cache in enumerate(caches)}
        self._partial: dict[tuple[int, int, int], list] = {}  # (layer, kv, i) -> [buffer, n]
        self._received: dict[tuple[int, int], int] = {}
        self.num_bytes = 0

    def write(self, layer: int, kv_index: int, offset: int, data: bytes) -> None:
        key = (layer, kv_index)
        block_bytes = self._block_bytes.get(key)
        if block_bytes is None:
            raise ValueError(f"KV chunk for layer {layer}, kv_index {kv_index} is out of range")
        payload_bytes = block_bytes * len(self.block_ids)
        if offset < 0 or offset + len(data) > payload_bytes:
            raise ValueError(f"KV chunk [{offset}, {offset + len(data)}) is outside the "
                             f"{payload_bytes}-byte payload of layer {layer}, "
                             f"kv_index {kv_index}")
        cache = self.kv_caches[layer][kv_index]
        received = _read_only_bytes(data)
        pos = 0
        while pos < len(data):
            block, within = divmod(offset + pos, block_bytes)
            whole = (len(data) - pos) // block_bytes if within == 0 else 0
            if whole:
                self._write_blocks(cache, block, received[pos: pos + whole * block_bytes])
                pos += whole * block_bytes
                continue
            take = min(block_bytes - within, len(data) - pos)
            part = self._partial.setdefault(
                (layer, kv_index, block), [torch.empty(block_bytes, dtype=torch.uint8), 0])
            part[0][within: within + take] = received[pos: pos + take]
            part[1] += take
            if part[1] >= block_bytes:
                self._write_blocks(cache, block, part[0])
                del self._partial[(layer, kv_index, block)]
            pos += take
        self._received[key] = self._received.get(key, 0) + len(data)
        self.num_bytes += len(data)

    def _write_blocks(self, cache: torch.Tensor, first: int, data: torch.Tensor) -> None:
        """data: uint8, a whole number of blocks of `cache` for block_ids[first:]."""
        count = data.numel() // (cache[0].numel() * cache.element_size())
        blocks = data.view(cache.dtype).view(count, *cache.shape[1:]).to(cache.device)
        if cache.device.type != "cpu":
            cache.index_copy_(0, self._index[first: first + count], blocks)
            return
        # On the host one copy per block (a plain memcpy each) beat index_copy_ by 2-4x in
        # bench/kv_transfer.py --device cpu: that one went through the intra-op thread pool
        # while the event loop's other work held the cores.
        for i, block in enumerate(self.block_ids[first: first + count]):
            cache[block].copy_(blocks[i])

    def check_complete(self) -> None:
        missing = sorted(key for key, size in self._block_bytes.items()
                         if self._received.get(key) != size * len(self.block_ids))
        if self.block_ids and missing:
            layer, kv_index = missing[0]
            raise ValueError(f"KV transfer incomplete: {len(missing)} of "
                             f"{len(self._block_bytes)} payloads missing or short (first: "
                             f"layer {layer}, kv_index {kv_index})")
