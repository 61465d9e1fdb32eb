"""The layout of a worker's paged KV cache, carried in every KV handle.

A receiver reads another worker's blocks only if both layouts agree on everything that decides
the bytes of a block; otherwise it refuses with an error naming every field that differs.

Three kinds, after what each attention layer keeps (ops/kv_cache.py):

  "mha"          two tensors per layer, K and V: [blocks, block_size, num_kv_heads, head_dim]
  "mla"          one tensor per layer, the latent: [blocks, block_size, 1, kv_lora_rank + rope
                 dim] (num_kv_heads = 1, head_dim = kv_lora_rank + qk_rope_head_dim)
  "mla_indexer"  two tensors per layer, the "mla" latent and then the sparse-attention
                 indexer's keys: [blocks, block_size, 1, index_head_dim] (DeepSeek-V3.2;
                 index_head_dim is 0 for the other kinds)

A receiver needs every tensor of the source's kind: a DeepSeek-V3.2 worker that got latents
without indexer keys would select its sparse keys from zeros, so "mla" and "mla_indexer" refuse
each other like any other pair of kinds.

How much smaller an MLA block is: per token and layer MLA keeps kv_lora_rank + qk_rope_head_dim
values, while the same model cached as MHA would keep H * (qk_nope + qk_rope + v) head dims. For
DeepSeek-V3 (H = 128, 512 + 64 latent, 128 + 64 key and 128 value dims): 576 values against
128 * 320 = 40,960, about 71x smaller. Per GPU under TP 8 the latent is replicated on each rank
while the heads split, so 576 against 16 * 320 = 5,120: about 9x. (The "~14x" often quoted is
DeepSeek-V2's comparison with DeepSeek 67B's cache, a different model: 93.3% smaller.)
DeepSeek-V3.2 adds its indexer's 128-wide key: 704 values per token and layer.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

KINDS = ("mha", "mla", "mla_indexer")
_NUM_TENSORS = {"mha": 2, "mla": 1, "mla_indexer": 2}


class KVLayoutMismatch(ValueError):
    """The source's KV blocks cannot be read by this worker."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    kind: str  # one of KINDS (module docstring)
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int  # K/V head size, or the latent's width
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    tp_rank: int = 0
    tp_size: int = 1
    index_head_dim: int = 0  # "mla_indexer" only: the indexer key's width

    @classmethod
    def from_kv_caches(cls, kv_caches: list[tuple[torch.Tensor, ...]],
                       tp_rank: int = 0, tp_size: int = 1, kind: str | None = None
                       ) -> KVLayout:
        """The layout of a model runner's caches. kind: what the attention ops declare
        (model_runner.kv_cache_kind), checked against the tensors; None infers it: (K, V) of
        one shape is MHA, (latent,) MLA, two single-head tensors of different widths MLA with
        indexer keys. Every layer must hold the same tensors (ValueError naming the first that
        differs)."""
        if not kv_caches:
            raise ValueError("kv_caches is empty: no attention layer keeps a KV cache")
        first = kv_caches[0]
        signature = [(tuple(c.shape[1:]), c.dtype) for c in first]
        for layer, caches in enumerate(kv_caches):
            if [(tuple(c.shape[1:]), c.dtype) for c in caches] != signature:
                raise ValueError(f"kv_caches: layer {layer} holds different cache tensors than "
                                 f"layer 0; a KV layout needs every layer alike")
        shapes = [shape for shape, _ in signature]
        if kind is None:
            kind = _infer_kind(shapes)
        _check_kind(kind, shapes)
        _, block_size, num_kv_heads, head_dim = first[0].shape
        index_head_dim = first[1].shape[-1] if kind == "mla_indexer" else 0
        return cls(kind, len(kv_caches), block_size, num_kv_heads, head_dim,
                   str(first[0].dtype).removeprefix("torch."), tp_rank, tp_size,
                   index_head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of one layer's first cache tensor (K or the latent)."""
        return self.block_size * self.num_kv_heads * self.head_dim * self._itemsize

    @property
    def bytes_per_layer_block(self) -> int:
        """Bytes of one block of every cache tensor of one layer."""
        if self.kind == "mla_indexer":
            return self.bytes_per_block + self.block_size * self.index_head_dim * self._itemsize
        return self.bytes_per_block * _NUM_TENSORS.get(self.kind, 1)

    @property
    def _itemsize(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

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
            if "mla_indexer" in (self.kind, receiver.kind):
                lead += (" (DeepSeek-V3.2's sparse attention needs the indexer keys beside "
                         "the MLA latent)")
        raise KVLayoutMismatch(f"{lead} (" + "; ".join(differing) + ")")

    def as_dict(self) -> dict:
        return asdict(self)


def _infer_kind(shapes: list[tuple[int, ...]]) -> str:
    if len(shapes) == 1:
        return "mla"
    if len(shapes) == 2 and shapes[0] == shapes[1]:
        return "mha"
    if len(shapes) == 2 and shapes[0][1] == shapes[1][1] == 1:
        return "mla_indexer"
    raise ValueError(f"kv_caches: {len(shapes)} tensors of shapes {shapes} per layer are "
                     f"neither MHA's (K, V), MLA's (latent,) nor MLA's with indexer keys "
                     f"(latent, index keys)")


def _check_kind(kind: str, shapes: list[tuple[int, ...]]) -> None:
    """shapes: a layer's cache tensors without the block dim, [block_size, heads, dim] each."""
    if kind not in KINDS:
        raise ValueError(f"kv_caches: unknown KV cache kind {kind!r} (known: {', '.join(KINDS)})")
    if len(shapes) != _NUM_TENSORS[kind] or (kind == "mha" and shapes[0] != shapes[1]):
        raise ValueError(f"kv_caches: {len(shapes)} tensors of shapes {shapes} per layer do "
                         f"not make a {kind!r} cache")
    heads = [shape[1] for shape in shapes if shape[1] != 1]
    if kind != "mha" and heads:
        raise ValueError(f"kv_caches: an MLA latent cache has 1 head, not {heads[0]} (and "
                         f"so do its indexer keys)")
