"""Turns a scheduled batch into model inputs, runs the model, and returns next-token logits.

Owns the paged KV cache tensors (whatever each KV-owning op asks for: K and V per MHA layer,
one latent tensor per MLA layer, the latent and the indexer keys per DeepSeek-V3.2 layer; see
ops/kv_cache.py) and nothing about scheduling or sampling
policy.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tandem.common.logging import get_logger
from tandem.workers.engine.cuda_graphs import DecodeGraphs
from tandem.workers.engine.host_to_device import as_device_tensor
from tandem.workers.engine.packed_inputs import INPUT_HEADER, input_header, table_width
from tandem.workers.engine.prefill_graphs import PrefillGraphs, prefill_buckets
from tandem.workers.engine.scheduler import SchedulerOutput
from tandem.workers.ops.attention import AttentionMetadata
from tandem.workers.ops.kv_cache import KVCacheOwner, kv_cache_kind_of

logger = get_logger(__name__)


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [N] int64: the last new token of every sampled sequence
    # The int64 device buffer that input_ids, positions and slot_mapping are views of, with
    # the step's lengths and block table, after a header (packed_inputs.py): what a decode
    # CUDA graph copies its inputs from (ops/gpu/graph_inputs.py). None: built otherwise,
    # and run eagerly.
    packed: torch.Tensor | None = None


def kv_cache_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across every tensor of every KV-owning layer."""
    numel = sum(math.prod(shape) for layer in attention_layers(model)
                for shape in layer.kv_cache_shapes(1, block_size))
    return numel * torch.tensor([], dtype=dtype).element_size()


def attention_layers(model: nn.Module) -> list[KVCacheOwner]:
    """The ops that keep a paged KV cache, in model order (one per attention layer)."""
    return [m for m in model.modules() if isinstance(m, KVCacheOwner)]


def kv_cache_kind(model: nn.Module) -> str | None:
    """The kind of KV cache the model's attention ops declare (ops/kv_cache.py), for the KV
    layout its handles carry."""
    return kv_cache_kind_of(attention_layers(model))


class ModelRunner:
    def __init__(self, model: nn.Module, num_kv_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.graphs: DecodeGraphs | None = None  # set by enable_cuda_graphs
        self.prefill_graphs: PrefillGraphs | None = None  # likewise
        layers = attention_layers(model)
        if not layers:
            raise ValueError(f"{type(model).__name__} has no KV-cache-owning attention layers")
        # [layer] -> that op's tensors, each [num_kv_blocks, block_size, ...]: (K, V) for MHA,
        # (latent,) for MLA, (latent, index keys) for sparse MLA. When every layer's tensors have
        # one shape they are views of one block-major allocation [num_kv_blocks, tensors, block]:
        # block b of every layer is one contiguous range, so a KV transfer moves a block in one
        # piece (one NIXL descriptor instead of one per tensor; kv/nixl_backend.py) and one
        # kernel gathers every layer (kv/cuda_ipc.py stacked_view). Each tensor's blocks are
        # contiguous, its slots are not (ops index slots as block, offset: ops/kv_cache.py).
        shapes = [list(layer.kv_cache_shapes(num_kv_blocks, block_size)) for layer in layers]
        stack = None
        if all(shape == shapes[0][0] for layer_shapes in shapes for shape in layer_shapes):
            stack = torch.zeros((num_kv_blocks, sum(map(len, shapes)), *shapes[0][0][1:]),
                                dtype=dtype, device=device)
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []
        next_slice = 0
        for layer, layer_shapes in zip(layers, shapes):
            if stack is not None:
                caches = tuple(stack[:, next_slice + i] for i in range(len(layer_shapes)))
                next_slice += len(layer_shapes)
            else:
                caches = tuple(torch.zeros(shape, dtype=dtype, device=device)
                               for shape in layer_shapes)
            layer.bind_kv_cache(*caches)
            self.kv_caches.append(caches)
        total = sum(c.numel() * c.element_size() for caches in self.kv_caches for c in caches)
        logger.info("KV cache: %d blocks x %d tokens, %d layers, %.1f MB", num_kv_blocks,
                    block_size, len(layers), total / 1e6)

    def enable_cuda_graphs(self, capture_sizes: list[int], max_model_len: int,
                           prefill_tokens: int = 0) -> None:
        """Capture decode graphs; later decode batches up to the largest size replay them.
        prefill_tokens > 0: also prefill graphs for one prompt's step of up to that many new
        tokens (prefill_graphs.py; executor.prefill_graph_tokens decides which models take
        them); over cached context for a K/V cache in bf16 / fp16 only."""
        self.graphs = DecodeGraphs(self.model, capture_sizes, max_model_len, self.block_size,
                                   self.device)
        buckets = prefill_buckets(prefill_tokens)
        if buckets:
            kind = kv_cache_kind(self.model)
            width = table_width(-(-(max_model_len + buckets[-1]) // self.block_size))
            try:
                self.prefill_graphs = PrefillGraphs(
                    self.model, buckets, max_model_len, width, self.device,
                    paged=kind == "mha" and self.dtype in (torch.bfloat16, torch.float16))
            except RuntimeError as err:  # torch.OutOfMemoryError is one too
                # Prefill graphs are a speed-up only: an op that cannot be captured, or a
                # pool that does not fit, leaves prefills eager rather than the worker down.
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
                first_line = (str(err).splitlines() or [""])[0][:300]
                logger.warning("prefill CUDA graphs not captured, prefills run eagerly: %s: %s",
                               type(err).__name__, first_line)

    def release_cuda_graphs(self) -> None:
        """Frees the decode graphs (later decode steps run eagerly) once the GPU is done with
        them."""
        if self.graphs is not None or self.prefill_graphs is not None:
            torch.cuda.synchronize(self.device)
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        if self.prefill_graphs is not None:
            self.prefill_graphs.release()
            self.prefill_graphs = None

    def prepare_inputs(self, batch: SchedulerOutput) -> ModelInputs:
        """The step's tokens, positions, KV slots, sequence bounds, padded block tables and
        sampled rows, built in one int64 host buffer with numpy (no per-token Python loop:
        an 8k-token prompt or a few hundred decodes with long tables is a few array ops) and
        sent to the device in one copy."""
        items = batch.scheduled
        num_seqs, bs = len(items), self.block_size
        starts = [item.seq.num_computed_tokens for item in items]
        counts = [item.num_new_tokens for item in items]
        seq_lens = [start + count for start, count in zip(starts, counts)]
        query_start_loc = [0, *itertools.accumulate(counts)]
        total = query_start_loc[-1]
        logits_indices = [query_start_loc[row + 1] - 1 for row, item in enumerate(items)
                          if item.is_sampled]
        table_lens = [len(item.seq.block_table) for item in items]
        width = table_width(max(table_lens))

        # One buffer for every part (host_to_device.py: one copy that does not wait for the
        # device, so a step's inputs can be built while the previous step runs), after the
        # header that says where they are (input_header). Each part starts 16-byte aligned,
        # as a tensor of its own would: Triton specializes kernels on pointer alignment.
        sizes = [total, total, total, num_seqs + 1, num_seqs, num_seqs * width,
                 len(logits_indices)]
        padded = [size + size % 2 for size in sizes]
        offsets = list(itertools.accumulate(padded, initial=INPUT_HEADER))
        host = np.zeros(offsets[-1], np.int64)
        host[:INPUT_HEADER] = input_header(num_seqs, width, offsets[:-1])
        ids, pos, slot_mapping, starts_at, lens, flat_tables, logits_at = (
            host[offset:offset + size] for offset, size in zip(offsets, sizes))
        ids[:] = np.fromiter(itertools.chain.from_iterable(
            item.seq.token_ids[start:end] for item, start, end in zip(items, starts, seq_lens)),
            np.int64, total)
        tables = flat_tables.reshape(num_seqs, width)  # padded with block 0, never read
        tables[np.arange(width) < np.array(table_lens)[:, None]] = np.fromiter(
            itertools.chain.from_iterable(item.seq.block_table for item in items), np.int64,
            sum(table_lens))
        if total == num_seqs:  # a token each (decode)
            row_of_token, pos[:] = np.arange(num_seqs), starts
        else:
            row_of_token = np.repeat(np.arange(num_seqs), counts)
            pos[:] = np.arange(total) - np.repeat(np.array(query_start_loc[:-1]) - starts, counts)
        block_index, offset = np.divmod(pos, bs)  # flat indexing: a third of a 2-D gather
        slot_mapping[:] = flat_tables[row_of_token * width + block_index] * bs + offset
        starts_at[:], lens[:], logits_at[:] = query_start_loc, seq_lens, logits_indices

        values = as_device_tensor(host, torch.int64, self.device)
        (ids, pos, slot_mapping, starts, lens, flat_tables, logits_at) = \
            (values[offset:offset + size] for offset, size in zip(offsets, sizes))
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=starts.to(torch.int32),
            seq_lens=lens.to(torch.int32),
            block_tables=flat_tables.view(num_seqs, width).to(torch.int32),
            max_query_len=max(counts),
            max_seq_len=max(seq_lens),
            query_start_loc_host=query_start_loc,
            seq_lens_host=seq_lens,
        )
        return ModelInputs(ids, pos, meta, logits_at, values)

    @torch.inference_mode()
    def run(self, batch: SchedulerOutput) -> torch.Tensor:
        """Logits [N, V] (fp32) for the sampled sequences of the batch, in batch order."""
        return self.execute(self.prepare_inputs(batch))

    @torch.inference_mode()
    def execute(self, inputs: ModelInputs) -> torch.Tensor:
        """Logits [N, V] (fp32) for prepared inputs (every TP rank runs the same inputs)."""
        meta = inputs.meta
        if self.graphs is not None and inputs.packed is not None \
                and inputs.logits_indices.numel() == meta.num_seqs \
                and self.graphs.can_run(meta.num_seqs, meta.max_query_len,
                                        -(-meta.max_seq_len // self.block_size),
                                        inputs.packed.numel()):
            # One token per sequence, every one sampled: logits_indices is 0..B-1.
            return self.graphs.run(inputs.packed, meta.num_seqs).float()
        if self.prefill_graphs is not None and self.prefill_graphs.can_run(
                meta, inputs.input_ids.shape[0], inputs.logits_indices.numel()):
            return self.prefill_graphs.run(inputs.input_ids, inputs.positions, meta,
                                           inputs.logits_indices).float()
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)  # [T, D]
        if inputs.logits_indices.numel() == 0:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        return self.model.compute_logits(hidden[inputs.logits_indices]).float()
