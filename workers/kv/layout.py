"""The layout of a worker's paged KV cache, carried in every KV handle.

A receiver reads another worker's blocks only if both layouts agree on everything that decides
the bytes of a block; otherwise it refuses with an error naming every field that differs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch


class KVLayoutMismatch(ValueError):
    """The source's KV blocks cannot be read by this worker."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    kind: str  # "mha": per layer, K and V caches of [blocks, block_size, kv_heads, head_dim]
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    tp_rank: int = 0
    tp_size: int = 1

    @classmethod
    def from_kv_caches(cls, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                       tp_rank: int = 0, tp_size: int = 1) -> KVLayout:
        k_cache = kv_caches[0][0]
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        return cls("mha", len(kv_caches), block_size, num_kv_heads, head_dim,
                   str(k_cache.dtype).removeprefix("torch."), tp_rank, tp_size)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def check_readable_by(self, receiver: KVLayout) -> None:
        differing = [f"{f.name}: source {getattr(self, f.name)!r} != receiver "
                     f"{getattr(receiver, f.name)!r}" for f in fields(self)
                     if getattr(self, f.name) != getattr(receiver, f.name)]
        if differing:
            raise KVLayoutMismatch("KV layout mismatch (" + "; ".join(differing) + ")")

    def as_dict(self) -> dict:
        return asdict(self)
