"""Token embedding and LM head, split over the vocabulary across TP ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tandem.workers.ops.linear import tp_rank_and_size
from tandem.workers.parallel.all_reduce import tp_all_reduce


class VocabParallelEmbedding(nn.Module):
    """Each TP rank holds a contiguous slice of ceil(V / tp) rows; lookups outside the slice
    give zeros and the all-reduce sums the one rank that owns each token."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.vocab_size = vocab_size
        self.rows_per_partition = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_partition
        self.weight = nn.Parameter(torch.zeros(self.rows_per_partition, hidden_size),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.num_shards = 1

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.dim() != 2 or loaded.shape[0] != self.vocab_size \
                or loaded.shape[1] != param.shape[1]:
            raise ValueError(f"embedding: expected shape ({self.vocab_size}, {param.shape[1]}), "
                             f"checkpoint has {tuple(loaded.shape)}")
        rows = loaded[self.vocab_start: self.vocab_start + self.rows_per_partition]
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, D]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_slice = (local >= 0) & (local < self.rows_per_partition)
        out = F.embedding(local.clamp(0, self.rows_per_partition - 1), self.weight)
        out = out * in_slice.unsqueeze(-1).to(out.dtype)
        tp_all_reduce(out)
        return out


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the full vocabulary (gathered across TP ranks)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V]
        logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(parts, logits)
            logits = torch.cat(parts, dim=-1)
        return logits[:, : self.vocab_size]
