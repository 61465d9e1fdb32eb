"""The layout of a worker's paged KV cache, carried in every KV handle.

A receiver reads another worker's blocks only if both layouts agree on everything that decides
the bytes of a block; otherwise it refuses with an error naming every field that differs.

Two kinds, after what each attention layer keeps (ops/kv_cache.py):

  "mha"  two tensors per layer, K and V: [blocks, block_size, num_kv_heads, head_dim]
  "mla"  one tensor per layer, the latent: [blocks, block_size, 1, kv_lora_rank + rope dim]
         (num_kv_heads = 1, head_dim = kv_lora_rank + qk_rope_head_dim)

How much smaller an MLA block is: per token and layer MLA keeps kv_lora_rank + qk_rope_head_dim
values, while the same model cached as MHA would keep H * (qk_nope + qk_rope + v) head dims. For
DeepSeek-V3 (H = 128, 512 + 64 latent, 128 + 64 key and 128 value dims): 576 values against
128 * 320 = 40,960, about 71x smaller. Per GPU under TP 8 the latent is replicated on each rank
while the heads split, so 576 against 16 * 320 = 5,120: about 9x. (The "~14x" often quoted is
DeepSeek-V2's comparison with DeepSeek 67B's cache, a different model: 93.3% smaller.)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

KINDS = ("mha", "mla")


class KVLayoutMismatch(ValueError):
    """The source's KV blocks cannot be read by this worker."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    kind: str  # one of KINDS (module docstring)
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    tp_rank: int = 0
    tp_size: int = 1

    @classmethod
    def from_kv_caches(cls, kv_caches: list[tuple[torch.Tensor, ...]],
                       tp_rank: int = 0, tp_size: int = 1) -> KVLayout:
        """The layout of a model runner's caches: (K, V) per layer is MHA, (latent,) is MLA.
        Every layer must hold the same tensors (ValueError naming the first that differs)."""
        if not kv_caches:
            raise ValueError("kv_caches is empty: no attention layer keeps a KV cache")
        first = kv_caches[0]
        signature = [(tuple(c.shape[1:]), c.dtype) for c in first]
        for layer, caches in enumerate(kv_caches):
            if [(tuple(c.shape[1:]), c.dtype) for c in caches] != signature:
                raise ValueError(f"kv_caches: layer {layer} holds different cache tensors than "
                                 f"layer 0; a KV layout needs every layer alike")
        kind = {2: "mha", 1: "mla"}.get(len(first))
        if kind is None or (kind == "mha" and signature[0] != signature[1]):
            raise ValueError(f"kv_caches: {len(first)} tensors of shapes "
                             f"{[s for s, _ in signature]} per layer are neither MHA's (K, V) "
                             f"nor MLA's (latent,)")
        _, block_size, num_kv_heads, head_dim = first[0].shape
        if kind == "mla" and num_kv_heads != 1:
            raise ValueError(f"kv_caches: an MLA latent cache has 1 head, not {num_kv_heads}")
        return cls(kind, len(kv_caches), block_size, num_kv_heads, head_dim,
                   str(first[0].dtype).removeprefix("torch."), tp_rank, tp_size)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of one cache tensor (K, V or latent) of one layer."""
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def check_readable_by(self, receiver: KVLayout) -> None:
        differing = [f"{f.name}: source {getattr(self, f.name)!r} != receiver "
                     f"{getattr(receiver, f.name)!r}" for f in fields(self)
                     if getattr(self, f.name) != getattr(receiver, f.name)]
        if not differing:
            return
        lead = "KV layout mismatch"
        if self.kind != receiver.kind:
            lead += (f": the source keeps a {self.kind!r} KV cache and this worker a "
                     f"{receiver.kind!r} one, so it cannot read the source's blocks")
        raise KVLayoutMismatch(f"{lead} (" + "; ".join(differing) + ")")

    def as_dict(self) -> dict:
        return asdict(self)
