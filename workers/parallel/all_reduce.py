"""The TP group's all-reduce, as every op calls it: `tp_all_reduce(x)` sums x over the ranks
in place.

Small CUDA tensors go through the one-shot kernel (one_shot_all_reduce.py) when the worker's
ranks set it up at start-up (process_group.init_rank_group, every rank together); everything
else through the default process group (NCCL on GPUs, gloo on CPU). This module imports no
Triton, so CPU workers never load it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_one_shot = None  # a one_shot_all_reduce.OneShotAllReduce, or None


def use_one_shot(all_reduce) -> None:
    """Route small all-reduces through `all_reduce` (None: the process group only). Every
    rank of the group must make the same choice (OneShotAllReduce.create sees to it)."""
    global _one_shot
    _one_shot = all_reduce


def tp_all_reduce(x: torch.Tensor) -> None:
    if _one_shot is not None and _one_shot.fits(x):
        _one_shot(x)
    else:
        dist.all_reduce(x)
