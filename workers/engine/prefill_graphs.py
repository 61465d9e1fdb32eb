"""CUDA graphs for a lone fresh prompt's prefill, padded to a bucket of tokens.

A prefill of up to a few thousand tokens is bound by the host, not the GPU: each layer is a
dozen launches from Python, and on a serving host's CPU the ~700 launches of a 48-layer MoE
model take longer than their kernels (bench/RESULTS.md, prefill host time). One graph per
bucket replays the whole forward in one launch. A prompt of T tokens runs on the smallest
bucket B >= T, its rows padded at the end:

    padded token: the id and position a previous prompt left there (any valid value), slot -1
    (the KV write skips it)

Why padding at the end is exact: attention is causal, so no real token reads a padded one,
and every other op is row-wise; the logits row is the last real token's, picked by a device
index filled before the replay. The padded rows' work is wasted, which is why the buckets
are spaced by at most 1.5x.

Taken (`can_run`) for one sequence with nothing cached (its query is all of its keys) and at
most the largest bucket's tokens: the first step of a new request with no prefix hit, which on
a prefill worker is most steps, or the first chunk of a longer prompt (no row sampled: the
graph's logits row is computed and not returned). Anything else runs eagerly.

Invariants, as for the decode graphs (cuda_graphs.py): every graph reads the same static
buffers, which `run` fills before the replay; launch shapes depend only on the bucket; the
graphs share one memory pool and replay one at a time on the engine thread. The model runner
captures them for models whose attention layers keep a K/V ("mha") or MLA latent ("mla")
cache, whose fresh prefill reads only the step's own rows; not for DeepSeek-V3.2's indexer
cache, whose top-k selection reads host-side lengths that padding would not describe.
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
    def __init__(self, model: nn.Module, buckets: list[int], max_blocks: int,
                 device: torch.device) -> None:
        self.model = model
        self.buckets = sorted(buckets)
        self.max_tokens = self.buckets[-1]
        n = self.max_tokens
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.last = torch.zeros(1, dtype=torch.int64, device=device)  # the sampled row
        self.block_tables = torch.zeros(1, max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.num_replays = 0  # prefill steps served by a graph (tests, bench)
        self._metas: dict[int, AttentionMetadata] = {}  # per bucket; its graph reads them
        self._capture(device)

    def _meta(self, bucket: int) -> AttentionMetadata:
        device = self.input_ids.device
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=torch.tensor([0, bucket], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([bucket], dtype=torch.int32, device=device),
            block_tables=self.block_tables, max_query_len=bucket, max_seq_len=bucket,
            query_start_loc_host=[0, bucket], seq_lens_host=[bucket])

    def _forward(self, bucket: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket],
                            self._metas[bucket])
        return self.model.compute_logits(hidden[self.last])

    def _capture(self, device: torch.device) -> None:
        started = time.monotonic()
        self._metas = {bucket: self._meta(bucket) for bucket in self.buckets}
        self.graphs, self.logits = capture_each(self.buckets, self._forward, device)
        logger.info("captured %d prefill CUDA graphs (a lone fresh prompt of up to %d tokens, "
                    "buckets %s) in %.1f s", len(self.buckets), self.max_tokens,
                    ",".join(map(str, self.buckets)), time.monotonic() - started)

    def release(self) -> None:
        """Destroys every graph now; can_run is False after."""
        release_each(self.graphs, self.logits)
        self.max_tokens = 0

    def can_run(self, meta: AttentionMetadata, num_tokens: int, num_sampled: int) -> bool:
        return (num_tokens <= self.max_tokens and meta.num_seqs == 1 and num_sampled <= 1
                and meta.max_seq_len == num_tokens and bool(self.graphs))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits [1, V] of the prompt's last token, or [0, V] when logits_indices is empty
        (a chunk whose row is not sampled)."""
        tokens = input_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= tokens)
        self.input_ids[:tokens].copy_(input_ids)
        self.positions[:tokens].copy_(positions)
        self.slot_mapping[:tokens].copy_(meta.slot_mapping)
        self.slot_mapping[tokens:bucket].fill_(-1)
        if logits_indices.numel():
            self.last.copy_(logits_indices)
        self.graphs[bucket].replay()
        self.num_replays += 1
        return self.logits[bucket][:logits_indices.numel()]
