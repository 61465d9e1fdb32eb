"""How many KV blocks an engine allocates: arithmetic over given and measured sizes, no torch.

On a GPU (memory_profile.py measures the sizes; this module only combines them):

    budget     = gpu_memory_utilization x total            this worker's share of the device
    non-KV     = weights + peak activations + reserve       reserve: CUDA graphs, the sampler's
                                                            logits, allocations outside torch
    KV blocks  = (budget - non-KV) // bytes_per_block, at most what max_num_seqs sequences of
                 max_model_len hold (a tiny model would otherwise get millions of blocks, each
                 an entry in the block manager)

Memory already in use when the worker starts (other processes, other engines in this process)
is not part of the budget, but the budget must fit beside it: two workers at 0.45 share a GPU,
a second worker at 0.9 is refused with the sizes that do not add up.

On CPU a fixed byte budget takes the place of the measured share (size_kv_cache_from_budget),
and a given num_kv_blocks replaces both (fixed_kv_cache). Every failure is a ValueError that
names the sizes involved and the setting to change.
"""
from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """What one rank measured, in bytes (memory_profile.py)."""

    total_bytes: int  # the device's memory
    used_by_others_bytes: int  # in use on the device before this engine loaded anything
    weights_bytes: int  # this rank's weights (and buffers) once loaded
    peak_activation_bytes: int  # above the weights, during a prefill of max_num_batched_tokens
    reserved_bytes: int  # CUDA graphs, the sampler's logits, allocations outside torch


@dataclass(frozen=True, slots=True)
class KVCacheSize:
    num_blocks: int
    bytes_per_block: int
    block_size: int
    max_model_len: int

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_full_length_seqs(self) -> float:
        """Sequences of max_model_len tokens whose KV fits at once."""
        return self.num_blocks / blocks_per_seq(self.max_model_len, self.block_size)

    def describe(self) -> str:
        return (f"KV cache: {self.num_blocks} blocks = {self.num_tokens} tokens "
                f"({self.kv_bytes / GiB:.2f} GiB); {self.max_full_length_seqs:.2f} sequences "
                f"of max_model_len={self.max_model_len} fit")


def blocks_per_seq(max_model_len: int, block_size: int) -> int:
    return -(-max_model_len // block_size)


def check_gpu_memory_utilization(value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"gpu_memory_utilization={value} must be in (0, 1]: the fraction of "
                         "the device's memory this worker may use")


def size_kv_cache(profile: MemoryProfile, *, gpu_memory_utilization: float,
                  bytes_per_block: int, block_size: int, max_model_len: int,
                  max_num_seqs: int) -> KVCacheSize:
    """The KV blocks that fit in gpu_memory_utilization x the device beside everything else
    the worker holds (module docstring); at least one sequence of max_model_len must fit."""
    check_gpu_memory_utilization(gpu_memory_utilization)
    p, fraction = profile, gpu_memory_utilization
    if min(bytes_per_block, block_size, max_model_len, max_num_seqs) < 1:
        raise ValueError(f"bytes_per_block={bytes_per_block}, block_size={block_size}, "
                         f"max_model_len={max_model_len} and max_num_seqs={max_num_seqs} must "
                         "be >= 1")
    budget = int(fraction * p.total_bytes)
    free = p.total_bytes - p.used_by_others_bytes
    if budget > free:
        raise ValueError(
            f"gpu_memory_utilization={fraction} asks for {_gib(budget)} of the device's "
            f"{_gib(p.total_bytes)}, but {_gib(p.used_by_others_bytes)} are already in use by "
            f"other processes (or engines), leaving {_gib(free)}: lower it to at most "
            f"{free / p.total_bytes:.2f}, or free the device")
    if p.weights_bytes >= budget:
        raise ValueError(
            f"the weights ({_gib(p.weights_bytes)}) do not fit in gpu_memory_utilization="
            f"{fraction} x {_gib(p.total_bytes)} = {_gib(budget)}: raise "
            "gpu_memory_utilization, or split the model (tensor_parallel_size)")
    non_kv = p.weights_bytes + p.peak_activation_bytes + p.reserved_bytes
    kv_bytes = budget - non_kv
    need = blocks_per_seq(max_model_len, block_size)
    num_blocks = max(kv_bytes, 0) // bytes_per_block
    if num_blocks < need:
        raise ValueError(
            f"gpu_memory_utilization={fraction} x {_gib(p.total_bytes)} = {_gib(budget)} "
            f"leaves {_gib(max(kv_bytes, 0))} for KV after weights {_gib(p.weights_bytes)}, "
            f"activations {_gib(p.peak_activation_bytes)} and reserve "
            f"{_gib(p.reserved_bytes)}: {num_blocks} blocks, fewer than the {need} "
            f"({_gib(need * bytes_per_block)}) one sequence of max_model_len={max_model_len} "
            "needs; raise gpu_memory_utilization or lower max_model_len")
    num_blocks = min(num_blocks, max_num_seqs * need)
    return KVCacheSize(num_blocks, bytes_per_block, block_size, max_model_len)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f} GiB"


def size_kv_cache_from_budget(budget_bytes: int, *, max_num_seqs: int, bytes_per_block: int,
                              block_size: int, max_model_len: int) -> KVCacheSize:
    """A fixed byte budget (the CPU default), capped by what max_num_seqs sequences of
    max_model_len need."""
    need = blocks_per_seq(max_model_len, block_size)
    num_blocks = min(max_num_seqs * need, budget_bytes // bytes_per_block)
    if num_blocks < need:
        raise ValueError(f"kv_cache_memory_bytes={budget_bytes} holds {num_blocks} blocks = "
                         f"{num_blocks * block_size} tokens, fewer than max_model_len="
                         f"{max_model_len}: one full-length sequence must fit (raise "
                         "kv_cache_memory_bytes or num_kv_blocks, or lower max_model_len)")
    return KVCacheSize(num_blocks, bytes_per_block, block_size, max_model_len)


def fixed_kv_cache(num_blocks: int, *, bytes_per_block: int, block_size: int,
                   max_model_len: int) -> KVCacheSize:
    """The user's num_kv_blocks, which must hold one sequence of max_model_len."""
    if num_blocks < blocks_per_seq(max_model_len, block_size):
        raise ValueError(f"num_kv_blocks={num_blocks} holds {num_blocks * block_size} tokens, "
                         f"fewer than max_model_len={max_model_len}: one full-length sequence "
                         "must fit (raise num_kv_blocks or lower max_model_len)")
    return KVCacheSize(num_blocks, bytes_per_block, block_size, max_model_len)
