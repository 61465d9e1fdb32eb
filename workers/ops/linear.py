"""Linear layers that know how to load their (tensor-parallel) shard of a checkpoint tensor.

Column-parallel layers split the output dim across TP ranks; row-parallel layers split the
input dim and all-reduce. Packed layers (QKV, gate+up) hold several checkpoint tensors stacked
along the output dim; `weight_loader(param, tensor, shard_id)` writes one of them into its slice.
Every parameter carries `num_shards`: how many checkpoint tensors must be loaded into it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.workers.parallel.all_reduce import tp_all_reduce
from tandem.workers.parallel.context import current_parallel


def tp_rank_and_size() -> tuple[int, int]:
    """The tensor-parallel rank and size the model is being built for (0, 1 unless the
    engine set a `ParallelContext`; see workers/parallel/context.py)."""
    context = current_parallel()
    return context.tp_rank, context.tp_size


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: expected shape {tuple(dst.shape)}, checkpoint has "
                         f"{tuple(src.shape)}")
    dst.copy_(src)


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by the TP size {denominator}")
    return numerator // denominator


class LinearBase(nn.Module):
    """y = x W^T (+ b) with W [output_size_per_partition, input_size_per_partition]."""

    def __init__(self, input_size: int, output_size: int, bias: bool,
                 num_shards: int = 1) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.num_shards = num_shards
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
            self.bias.num_shards = num_shards
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        _copy_checked(param.data, loaded, "replicated linear")


class ColumnParallelLinear(LinearBase):
    """Output dim split across TP ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 num_shards: int = 1) -> None:
        tp_size = tp_rank_and_size()[1]
        super().__init__(input_size, _divide(output_size, tp_size, "output_size"), bias,
                         num_shards)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        rows = param.shape[0]
        _copy_checked(param.data, loaded.narrow(0, self.tp_rank * rows, rows)
                      if loaded.shape[0] == rows * self.tp_size else loaded, "column linear")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stacked, e.g. [gate | up]; shard_id indexes output_sizes."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, num_shards=len(output_sizes))

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"merged linear: shard_id={shard_id!r} not in "
                             f"[0, {len(self.output_sizes)})")
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        shard = loaded.narrow(0, self.tp_rank * size, size) \
            if loaded.shape[0] == size * self.tp_size else loaded
        _copy_checked(param.data.narrow(0, offset, size), shard, f"merged linear shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """[q | k | v] projections in one matmul. KV heads are split across ranks, or replicated
    when there are fewer KV heads than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        tp_size = tp_rank_and_size()[1]
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp_size, "num_attention_heads")
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.num_kv_head_replicas = max(1, tp_size // num_kv_heads)
        output_size = (num_heads + 2 * self.num_kv_heads * tp_size) * head_dim
        super().__init__(hidden_size, output_size, bias, num_shards=3)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, rank = 0, q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, rank = kv_size, self.tp_rank // self.num_kv_head_replicas
        else:
            raise ValueError(f"qkv linear: shard_id={shard_id!r} is not 'q', 'k' or 'v'")
        replicas = self.num_kv_head_replicas if shard_id != "q" else 1
        expected_rows = size * (self.tp_size // replicas)
        if loaded.shape[0] != expected_rows:
            raise ValueError(f"qkv linear shard {shard_id}: expected {expected_rows} rows, "
                             f"checkpoint has shape {tuple(loaded.shape)}")
        _copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, rank * size, size),
                      f"qkv linear shard {shard_id}")


class RowParallelLinear(LinearBase):
    """Input dim split across TP ranks; partial outputs are summed with an all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = tp_rank_and_size()[1]
        super().__init__(_divide(input_size, tp_size, "input_size"), output_size, bias)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if param.dim() == 1:  # bias: added once, after the reduction
            _copy_checked(param.data, loaded, "row linear bias")
            return
        cols = param.shape[1]
        shard = loaded.narrow(1, self.tp_rank * cols, cols) \
            if loaded.dim() == 2 and loaded.shape[1] == cols * self.tp_size else loaded
        _copy_checked(param.data, shard, "row linear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.tp_size > 1:
            tp_all_reduce(y)
        return y if self.bias is None else y + self.bias
