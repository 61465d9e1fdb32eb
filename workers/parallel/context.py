"""Which tensor/expert-parallel rank a model is being built for.

Ops read the current `ParallelContext` once, at construction, to size their shards; the engine
(rank 0) and each follower process set it around building the model:

    with use_parallel(ParallelContext(tp_rank=1, tp_size=2)):
        model = build_model(...)

Invariants:
  * A worker's ranks are the whole default torch.distributed process group of each of its
    processes (rank r of the group is TP rank r), so ops all-reduce on the default group.
  * Outside `use_parallel` the context is rank 0 of 1: a model built there never communicates,
    even in a process whose default group has several ranks.
  * With `enable_expert_parallel` the expert-parallel group is the TP group: rank r holds
    experts [r * E / tp, (r + 1) * E / tp) whole instead of a 1/tp slice of every expert.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tp_size} must be >= 1")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} outside [0, {self.tp_size})")

    @property
    def is_expert_parallel(self) -> bool:
        """Experts are partitioned across ranks (EP on, and more than one rank)."""
        return self.enable_expert_parallel and self.tp_size > 1


_SINGLE = ParallelContext()
_current: ParallelContext = _SINGLE


def current_parallel() -> ParallelContext:
    return _current


@contextmanager
def use_parallel(context: ParallelContext) -> Iterator[ParallelContext]:
    """Build models inside this block for `context`'s rank; restores the previous one."""
    global _current
    previous, _current = _current, context
    try:
        yield context
    finally:
        _current = previous
