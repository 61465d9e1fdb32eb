"""CUDA graphs for a lone prompt's prefill, padded to a bucket of tokens.

A prefill of up to a few thousand tokens is bound by the host, not the GPU: each layer is a
dozen launches from Python, and on a serving host's CPU the ~700 launches of a 48-layer MoE
model take longer than their kernels (bench/RESULTS.md, prefill host time). One graph per
bucket replays the whole forward in one launch. A step of T new tokens runs on the smallest
bucket B >= T, its rows padded at the end:

    padded token: the id a previous prompt left there (any valid id), position 0, slot -1
    (the KV write skips it)

Why padding at the end is exact: attention is causal, so no real token reads a padded one,
and every other op is row-wise; the logits row is the last real token's, picked by a device
index filled before the replay. The padded rows' work is wasted, which is why the buckets
are spaced by at most 1.5x.

Two families, each one graph per bucket (`can_run` picks; anything else runs eagerly):
* fresh: one sequence with nothing cached (its query is all of its keys): the first step of a
  new request with no prefix hit, which on a prefill worker is most steps, or the first chunk
  of a longer prompt (no row sampled: the graph's logits row is computed and not returned);
* over cached context (`paged`): one sequence whose first C tokens are cached (a chat's next
  turn after a prefix hit, a later chunk). The graph's sequence is C + B long: the padded
  queries sit after the real ones, seq_lens (device) says C + B, the block table is the
  sequence's, zero-padded to hold C + B positions, and the attention kernels take the longest
  context as a host bound fixed at capture (max_model_len + B). Only for a plain K/V cache in
  bf16 / fp16: there the attention reads lengths from the device (FlashAttention-4 or AITER
  unified_attention); fp32 and MLA take paths that read host-side lengths.

Invariants, as for the decode graphs (cuda_graphs.py): every graph reads the same static
buffers, which `run` fills before the replay; launch shapes depend only on the bucket; the
graphs share one memory pool and replay one at a time on the engine thread. The model runner
captures them for models whose attention layers keep a K/V ("mha") or MLA latent ("mla")
cache; not for DeepSeek-V3.2's indexer cache, whose top-k selection reads host-side lengths
that padding would not describe.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from tandem.common.logging import get_logger
from tandem.workers.engine.cuda_graphs import capture_each, release_each
from tandem.workers.ops.attention import AttentionMetadata

logger = get_logger(__name__)

SMALLEST_BUCKET = 128
# The KV cache kinds (ops/kv_cache.py) whose models these graphs pad correctly.
PREFILL_GRAPH_KINDS = ("mha", "mla")


def prefill_buckets(max_tokens: int) -> list[int]:
    """128, 192, 256, 384, ... up to max_tokens (each 1.5x or 1.33x the one before), and
    max_tokens itself; empty when max_tokens < SMALLEST_BUCKET."""
    buckets, size = [], SMALLEST_BUCKET
    while size <= max_tokens:
        buckets += [size, size * 3 // 2]
        size *= 2
    return sorted({b for b in buckets if b <= max_tokens} | ({max_tokens} if buckets else set()))


class PrefillGraphs:
    def __init__(self, model: nn.Module, buckets: list[int], max_model_len: int,
                 table_width: int, device: torch.device, paged: bool) -> None:
        """table_width: block-table columns that hold max_model_len + the largest bucket
        positions (and any step's padded table); paged: also capture the family over cached
        context."""
        self.model = model
        self.buckets = sorted(buckets)
        self.max_tokens = self.buckets[-1]
        self.max_model_len = max_model_len
        self.paged = paged
        n = self.max_tokens
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.last = torch.zeros(1, dtype=torch.int64, device=device)  # the sampled row
        self.seq_lens = torch.ones(1, dtype=torch.int32, device=device)  # paged: C + bucket
        self.block_tables = torch.zeros(1, table_width, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, bool], torch.Tensor] = {}
        self.num_replays = 0  # prefill steps served by a graph (tests, bench)
        self.num_paged_replays = 0  # of which over cached context
        # Per (bucket, paged): the metadata its graph was captured with (it reads the tensors).
        self._metas: dict[tuple[int, bool], AttentionMetadata] = {}
        self._capture(device)

    def _meta(self, bucket: int, paged: bool) -> AttentionMetadata:
        device = self.input_ids.device
        starts = torch.tensor([0, bucket], dtype=torch.int32, device=device)
        if not paged:
            return AttentionMetadata(
                slot_mapping=self.slot_mapping[:bucket], query_start_loc=starts,
                seq_lens=torch.tensor([bucket], dtype=torch.int32, device=device),
                block_tables=self.block_tables, max_query_len=bucket, max_seq_len=bucket,
                query_start_loc_host=[0, bucket], seq_lens_host=[bucket])
        longest = self.max_model_len + bucket  # a host bound: the lengths are on the device
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], query_start_loc=starts,
            seq_lens=self.seq_lens, block_tables=self.block_tables, max_query_len=bucket,
            max_seq_len=longest, query_start_loc_host=[0, bucket], seq_lens_host=[longest])

    def _forward(self, bucket: int, paged: bool) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket],
                            self._metas[bucket, paged])
        return self.model.compute_logits(hidden[self.last])

    def _capture(self, device: torch.device) -> None:
        started = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        for paged in (False, True) if self.paged else (False,):
            for bucket in self.buckets:
                self._metas[bucket, paged] = self._meta(bucket, paged)
            if paged:  # the warm-up forwards read a cached context of one position
                self.seq_lens.fill_(self.max_tokens + 1)
            graphs, logits = capture_each(self.buckets, lambda b: self._forward(b, paged),
                                          device, pool)
            self.graphs.update({(b, paged): g for b, g in graphs.items()})
            self.logits.update({(b, paged): out for b, out in logits.items()})
        logger.info("captured %d prefill CUDA graphs (one prompt's step of up to %d new tokens, "
                    "buckets %s%s) in %.1f s", len(self.graphs), self.max_tokens,
                    ",".join(map(str, self.buckets)),
                    "; fresh and over cached context" if self.paged else "; fresh prompts",
                    time.monotonic() - started)

    def release(self) -> None:
        """Destroys every graph now; can_run is False after."""
        release_each(self.graphs, self.logits)
        self.max_tokens = 0

    def can_run(self, meta: AttentionMetadata, num_tokens: int, num_sampled: int) -> bool:
        if not (0 < num_tokens <= self.max_tokens and meta.num_seqs == 1 and num_sampled <= 1
                and self.graphs):
            return False
        cached = meta.max_seq_len - num_tokens
        return cached == 0 or (self.paged and meta.block_tables.shape[1]
                               <= self.block_tables.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits [1, V] of the step's last token, or [0, V] when logits_indices is empty
        (a chunk whose row is not sampled)."""
        tokens = input_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= tokens)
        paged = meta.max_seq_len > tokens
        self.input_ids[:tokens].copy_(input_ids)
        self.positions[:tokens].copy_(positions)
        self.positions[tokens:bucket].zero_()
        self.slot_mapping[:tokens].copy_(meta.slot_mapping)
        self.slot_mapping[tokens:bucket].fill_(-1)
        if logits_indices.numel():
            self.last.copy_(logits_indices)
        if paged:
            width = meta.block_tables.shape[1]
            self.seq_lens.fill_(meta.max_seq_len - tokens + bucket)
            self.block_tables[:, :width].copy_(meta.block_tables)
            self.block_tables[:, width:].zero_()
            self.num_paged_replays += 1
        self.graphs[bucket, paged].replay()
        self.num_replays += 1
        return self.logits[bucket, paged][:logits_indices.numel()]
