"""CUDA graphs for decode steps: the whole forward (embedding to logits) replayed in one launch.

A decode step of a small batch is hundreds of short kernels; launched one by one from Python the
GPU idles between them (an 8B batch-1 step runs about twice as fast graphed as eager, even in
plain torch). One graph is captured per batch size in `capture_sizes`; a
batch runs on the smallest graph that holds it, its extra rows padded:

    padded row: input id 0, position 0, slot -1 (the KV write skips it), seq_len 1, block
    table row of zeros (it reads block 0 and its output is dropped)

Invariants that make replays correct:
* every graph reads its inputs from the same static buffers, which its first kernel fills
  from a staging buffer (ops/gpu/graph_inputs.py); `run` copies the step's packed inputs
  (ModelInputs.packed) there, one device-to-device copy, then replays;
* kernels on the decode path take lengths and block tables from those device buffers, and
  their launch shapes depend only on the batch size (the graphs are captured with
  max_seq_len = max_model_len, so e.g. the split count of the decode attention fits any length);
* all graphs share one memory pool and are replayed one at a time on the engine thread.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from tandem.common.logging import get_logger
from tandem.workers.engine.packed_inputs import max_packed_size
from tandem.workers.ops.attention import AttentionMetadata

logger = get_logger(__name__)


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


@torch.inference_mode()
def capture_each(sizes: list[int], forward: Callable[[int], torch.Tensor],
                 device: torch.device, pool: tuple | None = None
                 ) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, torch.Tensor]]:
    """One graph of forward(size) per size, largest first so that the later ones reuse its
    memory pool (`pool`, or a new one); each size runs once eagerly before its capture (every
    kernel compiles and autotunes outside it). Returns the graphs and the output tensors their
    replays rewrite."""
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, torch.Tensor] = {}
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for size in sorted(sizes, reverse=True):
            forward(size)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                outputs[size] = forward(size)
            graphs[size] = graph
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    return graphs, outputs


def release_each(graphs: dict, outputs: dict) -> None:
    """Destroys the graphs now and forgets them and their outputs."""
    for graph in graphs.values():
        graph.reset()
    graphs.clear()
    outputs.clear()


class DecodeGraphs:
    def __init__(self, model: nn.Module, capture_sizes: list[int], max_model_len: int,
                 block_size: int, device: torch.device) -> None:
        self.model = model
        self.sizes = sorted(capture_sizes)
        self.max_batch = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._static = (self.input_ids, self.positions, self.slot_mapping, self.seq_lens,
                        self.block_tables)  # what the graphs fill, in unpack_graph_inputs' order
        # The largest packed step a graph runs: max_batch sequences whose tables may hold a
        # block past max_blocks (allocated ahead of the sequence's next token).
        self.staged = torch.zeros(max_packed_size(n, self.max_blocks + 1), dtype=torch.int64,
                                  device=device)
        from tandem.workers.ops.gpu.graph_inputs import unpack_graph_inputs  # Triton: GPU only
        self._unpack_inputs = unpack_graph_inputs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0  # decode steps served by a graph (tests, bench)
        self.logits: dict[int, torch.Tensor] = {}
        self._capture(device)

    def _meta(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            query_start_loc=self.query_start_loc[:batch + 1],
            seq_lens=self.seq_lens[:batch], block_tables=self.block_tables[:batch],
            max_query_len=1, max_seq_len=self.max_model_len,
            query_start_loc_host=list(range(batch + 1)), seq_lens_host=[1] * batch)

    def _forward(self, batch: int) -> torch.Tensor:
        self._unpack_inputs(self.staged, self._static, batch)
        hidden = self.model(self.input_ids[:batch], self.positions[:batch], self._meta(batch))
        return self.model.compute_logits(hidden)

    def _capture(self, device: torch.device) -> None:
        started = time.monotonic()
        self.graphs, self.logits = capture_each(self.sizes, self._forward, device)
        logger.info("captured %d decode CUDA graphs (batch %s) in %.1f s", len(self.sizes),
                    ",".join(map(str, self.sizes)), time.monotonic() - started)

    def release(self) -> None:
        """Destroys every graph now, whoever still holds this object; can_run is False after."""
        release_each(self.graphs, self.logits)
        self.max_batch = 0

    def can_run(self, num_seqs: int, max_query_len: int, num_blocks: int,
                packed_size: int) -> bool:
        """Whether a step of num_seqs sequences, reading num_blocks blocks at most, with a
        packed input buffer of packed_size entries (ModelInputs.packed) replays a graph."""
        return (max_query_len == 1 and num_seqs <= self.max_batch
                and num_blocks <= self.max_blocks and packed_size <= self.staged.numel())

    def run(self, packed: torch.Tensor, batch: int) -> torch.Tensor:
        """Logits [B, V] of a decode batch of B sequences (one new token each) whose inputs
        are `packed` (ModelInputs.packed)."""
        size = next(s for s in self.sizes if s >= batch)
        # The graph's first kernel copies the rows and pads the rest (rows a previous, larger
        # batch left behind become padding again); the table's padded width may pass
        # max_blocks, and its columns past max_blocks are padding.
        self.staged[:packed.numel()].copy_(packed)
        self.graphs[size].replay()
        self.num_replays += 1
        return self.logits[size][:batch]
