"""Sizing one rank's KV cache: measure its GPU memory, then let kv_sizing.py do the arithmetic.

    start = memory_at_start(device)              # before the weights load
    ... load the model ...
    size = size_rank_kv_cache(config, loaded, start, capture_sizes)

On a GPU the rank measures what the device already holds, its weights, and the peak of a
prefill of max_num_batched_tokens dummy tokens (the largest step the scheduler builds), and
reserves room for what comes after sizing: the decode CUDA graphs' pool, the prefill graphs'
activations (prefill_graphs.py), the sampler's work on [max_num_seqs, vocab] logits, and
allocations outside torch's allocator (CUDA and NCCL handles, kernel modules). The cache never
outgrows max_num_seqs sequences of max_model_len.
Only this process's allocator counts as its own, so workers that start together on one GPU do
not mistake each other's loading for their own use.

On CPU the KV cache takes `kv_cache_memory_bytes` (2 GiB by default), capped by what
max_num_seqs sequences of max_model_len need. `num_kv_blocks` overrides both.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
from torch import nn

from tandem.common.logging import get_logger
from tandem.workers.engine.config import EngineConfig
from tandem.workers.engine.kv_sizing import (GiB, KVCacheSize, MemoryProfile, blocks_per_seq,
                                             fixed_kv_cache, size_kv_cache,
                                             size_kv_cache_from_budget)
from tandem.workers.engine.model_runner import (ModelInputs, attention_layers,
                                                kv_cache_bytes_per_block)
from tandem.workers.engine.model_setup import LoadedModel
from tandem.workers.ops.attention import AttentionMetadata

logger = get_logger(__name__)
# Bytes per logit the sampler may hold at once: fp32 logits, probabilities, a sorted copy with
# int64 indices (top-p), masks and noise.
SAMPLER_BYTES_PER_LOGIT = 32
# The decode graphs' pool beyond their [batch, vocab] outputs (static inputs, block tables,
# split-KV partials of the largest batch).
CUDA_GRAPH_BASE_BYTES = 256 << 20
# Device memory a rank takes outside torch's allocator after sizing (cuBLAS / NCCL state,
# Triton and CUDA modules), and slack for the allocator's fragmentation.
NON_TORCH_BYTES = 512 << 20


@dataclass(frozen=True, slots=True)
class MemoryAtStart:
    total_bytes: int
    used_bytes: int  # on the whole device, by every process (this one's CUDA context too)
    allocated_bytes: int  # by this process's torch allocator (an earlier engine, say)


def memory_at_start(device: torch.device) -> MemoryAtStart | None:
    """The device's memory before an engine loads anything on it (None on CPU). Memory that
    earlier, unreachable engines of this process still hold goes back to the device first."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return MemoryAtStart(total, total - free, torch.cuda.memory_allocated(device))


def size_rank_kv_cache(config: EngineConfig, loaded: LoadedModel, start: MemoryAtStart | None,
                       capture_sizes: list[int], prefill_graph_tokens: int = 0) -> KVCacheSize:
    """This rank's KV cache size (module docstring); capture_sizes: the decode graphs' batch
    sizes, or [] when decode runs eagerly; prefill_graph_tokens: the prefill graphs' largest
    bucket, 0 without them. Raises ValueError naming the sizes that do not fit."""
    bytes_per_block = kv_cache_bytes_per_block(loaded.model, config.block_size, loaded.dtype)
    if config.num_kv_blocks is not None:
        return fixed_kv_cache(config.num_kv_blocks, bytes_per_block=bytes_per_block,
                              block_size=config.block_size, max_model_len=loaded.max_model_len)
    if start is None:
        return size_kv_cache_from_budget(
            config.kv_cache_memory_bytes, max_num_seqs=config.max_num_seqs,
            bytes_per_block=bytes_per_block, block_size=config.block_size,
            max_model_len=loaded.max_model_len)
    profile = profile_memory(config, loaded, start, capture_sizes, prefill_graph_tokens)
    size = size_kv_cache(profile, gpu_memory_utilization=config.gpu_memory_utilization,
                         bytes_per_block=bytes_per_block, block_size=config.block_size,
                         max_model_len=loaded.max_model_len,
                         max_num_seqs=config.max_num_seqs)
    logger.info("GPU memory: %.2f GiB = %g x %.2f GiB (%.2f GiB in use by others); weights "
                "%.2f, activations %.2f, reserved %.2f GiB",
                config.gpu_memory_utilization * profile.total_bytes / GiB,
                config.gpu_memory_utilization, profile.total_bytes / GiB,
                profile.used_by_others_bytes / GiB, profile.weights_bytes / GiB,
                profile.peak_activation_bytes / GiB, profile.reserved_bytes / GiB)
    return size


def profile_memory(config: EngineConfig, loaded: LoadedModel, start: MemoryAtStart,
                   capture_sizes: list[int], prefill_graph_tokens: int = 0) -> MemoryProfile:
    """Measures the weights and one dummy prefill of max_num_batched_tokens tokens. Every TP
    rank runs it together (the forward's all-reduces pair up): the inputs depend only on the
    config, so all ranks build the same ones."""
    device, vocab_size = loaded.device, loaded.hf_config.vocab_size
    torch.cuda.synchronize(device)
    weights = torch.cuda.memory_allocated(device) - start.allocated_bytes
    lengths = _dummy_prompt_lengths(config.max_num_batched_tokens, config.max_num_seqs,
                                    loaded.max_model_len)
    num_blocks = sum(blocks_per_seq(n, config.block_size) for n in lengths)
    _bind_probe_caches(loaded.model, num_blocks, config.block_size, loaded.dtype, device)
    inputs = _dummy_prefill(lengths, config.block_size, vocab_size, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        hidden = loaded.model(inputs.input_ids, inputs.positions, inputs.meta)
        loaded.model.compute_logits(hidden[inputs.logits_indices]).float()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del hidden, inputs
    # The probe caches and the activations' segments go back before the KV cache is made.
    _bind_probe_caches(loaded.model, 0, config.block_size, loaded.dtype, device)
    torch.cuda.empty_cache()
    sampler = config.max_num_seqs * vocab_size * SAMPLER_BYTES_PER_LOGIT
    graphs = CUDA_GRAPH_BASE_BYTES + sum(capture_sizes) * vocab_size * 4 if capture_sizes else 0
    # The prefill graphs' pool holds the activations of their largest bucket for good, beside
    # an eager step's: the measured peak, scaled to that bucket's share of the probe's tokens.
    graphs += peak * prefill_graph_tokens // config.max_num_batched_tokens
    return MemoryProfile(total_bytes=start.total_bytes, used_by_others_bytes=start.used_bytes,
                         weights_bytes=weights, peak_activation_bytes=peak,
                         reserved_bytes=sampler + graphs + NON_TORCH_BYTES)


def _dummy_prompt_lengths(max_num_batched_tokens: int, max_num_seqs: int,
                          max_model_len: int) -> list[int]:
    """The fewest fresh prompts (each <= max_model_len) that fill one step's token budget."""
    lengths: list[int] = []
    remaining = max_num_batched_tokens
    while remaining > 0 and len(lengths) < max_num_seqs:
        lengths.append(min(remaining, max_model_len))
        remaining -= lengths[-1]
    return lengths


def _bind_probe_caches(model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> None:
    """KV caches of num_blocks blocks for the dummy prefill (0: empty ones, which free the
    probe's); ModelRunner binds the real ones later."""
    for layer in attention_layers(model):
        layer.bind_kv_cache(*(torch.zeros(shape, dtype=dtype, device=device)
                              for shape in layer.kv_cache_shapes(num_blocks, block_size)))


def _dummy_prefill(lengths: list[int], block_size: int, vocab_size: int,
                   device: torch.device) -> ModelInputs:
    """Fresh prompts of `lengths` tokens in consecutive blocks, each sampling one token."""
    num_tokens = sum(lengths)
    starts = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    first_blocks = [sum(blocks_per_seq(n, block_size) for n in lengths[:i])
                    for i in range(len(lengths))]
    width = max(blocks_per_seq(n, block_size) for n in lengths)
    tables = [[first + b for b in range(blocks_per_seq(n, block_size))]
              + [0] * (width - blocks_per_seq(n, block_size))
              for first, n in zip(first_blocks, lengths)]
    slots = [(first * block_size + p) for first, n in zip(first_blocks, lengths)
             for p in range(n)]
    positions = [p for n in lengths for p in range(n)]

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    meta = AttentionMetadata(
        slot_mapping=tensor(slots, torch.int64), query_start_loc=tensor(starts, torch.int32),
        seq_lens=tensor(lengths, torch.int32), block_tables=tensor(tables, torch.int32),
        max_query_len=max(lengths), max_seq_len=max(lengths), query_start_loc_host=starts,
        seq_lens_host=list(lengths))
    input_ids = torch.arange(num_tokens, device=device) % vocab_size
    return ModelInputs(input_ids, tensor(positions, torch.int64), meta,
                       tensor([s - 1 for s in starts[1:]], torch.int64))
