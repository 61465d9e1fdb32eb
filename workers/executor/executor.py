"""The executor: runs one scheduled step of the model on every rank of this worker and
returns the sampled tokens. The engine (scheduler, block manager, requests) sits above it and
sees only `execute`; which kind of executor it has, and whether other processes exist, is
decided once here, before the engine is built:

    executor = build_executor(config)      # the worker / tandem.LLM, at start-up
    engine = LLMEngine(config, executor)
    output = executor.execute(batch)       # per step: SamplerOutput (None: nothing sampled)
    logits = executor.launch_forward(batch, carried)  # or queued, read later (asynchronous
    sample = executor.launch_sample(logits, seqs)     # scheduling: DeviceSample.to_host)
    answers = executor.run_kv_ops(ops)     # KV transfer work on every rank (kv/rank_ops.py)
    executor.shutdown()                    # via engine.shutdown(), after the last step

`OneRankExecutor`: the model in this process. `MultiRankExecutor`: tensor parallelism; this
process is rank 0 and starts the follower ranks (executor/followers.py), which load their
shards at the same time, size their KV caches with rank 0 and replay every step
(executor/rank_runner.py). Sampling runs on rank 0 only, on the logits every rank computed
together.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tandem.common.checkpoint_files import eos_token_ids
from tandem.common.logging import get_logger
from tandem.workers.engine.config import EngineConfig, ResolvedConfig
from tandem.workers.engine.cuda_graphs import default_capture_sizes
from tandem.workers.engine.host_to_device import as_device_tensor, queued_copies
from tandem.workers.engine.kv_sizing import KVCacheSize
from tandem.workers.engine.memory_profile import (MemoryAtStart, memory_at_start,
                                                  size_rank_kv_cache)
from tandem.workers.engine.model_runner import ModelRunner, kv_cache_kind
from tandem.workers.engine.prefill_graphs import PREFILL_GRAPH_KINDS
from tandem.workers.engine.model_setup import LoadedModel, load_model
from tandem.workers.engine.sampler import DeviceSample, Sampler, SamplerOutput
from tandem.workers.engine.scheduler import SchedulerOutput
from tandem.workers.engine.sequence import Sequence
from tandem.workers.executor.rank_runner import LeaderRunner, RankGroup
from tandem.workers.executor.step_inputs import pack_kv_ops
from tandem.workers.kv.rank_ops import KVRankOp, RankKV, encode_ops
from tandem.workers.models.loader import load_hf_config
from tandem.workers.ops import kernel_options
from tandem.workers.ops.backend import KernelBackend, resolve_backend
from tandem.workers.parallel.context import ParallelContext
from tandem.workers.parallel.process_group import rank_device
from tandem.workers.parallel.validation import check_parallel_fits

logger = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class CarriedTokens:
    """Input tokens of a step that are the previous step's samples, still on the device."""

    tokens: torch.Tensor  # [N] long: what the previous step sampled, by its row
    rows: list[int]  # rows of this step whose input token is one of them
    sources: list[int]  # for each of those rows, its row in `tokens`


class Executor:
    """What the engine steps: the model runner (rank 0's, mirrored on the followers when
    there are any), its KV cache, and the sampler."""

    def __init__(self, loaded: LoadedModel, runner: ModelRunner | LeaderRunner,
                 resolved: ResolvedConfig, seed: int) -> None:
        self.model: nn.Module = loaded.model
        self.hf_config = loaded.hf_config
        self.runner = runner
        self.resolved = resolved
        self.sampler = Sampler(resolved.eos_token_ids, seed=seed)
        self.rank_kv = RankKV(runner.kv_caches, resolved.device, 0, self.tp_size)

    @property
    def tp_size(self) -> int:
        return 1

    @property
    def kv_caches(self):
        """This rank's (rank 0's) KV cache: [layer] -> tuple of [blocks, ...] tensors."""
        return self.runner.kv_caches

    @property
    def rank_group(self) -> RankGroup | None:
        """The follower ranks and their control channel (None: one rank)."""
        return None

    def execute(self, batch: SchedulerOutput,
                while_running: Callable[[], None] | None = None) -> SamplerOutput | None:
        """Runs the batch's step on every rank; the tokens sampled for the batch's sampled
        sequences, in batch order (None when the step samples none: a prefill chunk).
        while_running: host work to do once the step is queued on the device, before its
        tokens are read back (so it overlaps the step rather than following it)."""
        logits = self.runner.run(batch)  # [N, V] for the sampled sequences
        if while_running is not None:
            while_running()
        sampled = [item.seq for item in batch.scheduled if item.is_sampled]
        return self.sampler(logits, sampled) if sampled else None

    @property
    def supports_async_scheduling(self) -> bool:
        """Whether `launch_forward` works: one rank, whose device reads carried tokens
        itself."""
        return True

    def launch_forward(self, batch: SchedulerOutput,
                       carried: CarriedTokens | None) -> torch.Tensor:
        """Queues a decode step's forward pass; its logits [B, V], still being computed.
        Input tokens named by `carried` come from the previous step's samples on the device;
        the batch's token ids hold placeholders for them."""
        with queued_copies():
            inputs = self.runner.prepare_inputs(batch)
            if carried is not None:
                _carry_(inputs.input_ids, carried)
            return self.runner.execute(inputs)

    def launch_sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> DeviceSample:
        """Queues the sampling of a launched forward's logits (row i is seqs[i]'s), whose
        tokens' placeholders the sequences already end with. A constrained row's grammar must
        have accepted every token before its input token."""
        with queued_copies():
            return self.sampler.sample_on_device(logits, seqs, placeholders=True)

    def run_kv_ops(self, ops: list[KVRankOp]) -> list:
        """Runs KV rank ops on every rank, in order; rank 0's answer to each. Engine thread
        only (between steps), like every collective of the rank group."""
        return self.rank_kv.run(ops, None)

    def shutdown(self) -> None:
        """Releases what other processes share with this one. Idempotent; call it from the
        thread that drove the steps, after the last one."""
        self.rank_kv.close()


class OneRankExecutor(Executor):
    """The whole model in this process."""


class MultiRankExecutor(Executor):
    """Tensor parallelism: rank 0 here, ranks 1..tp-1 in follower processes it started."""

    def __init__(self, loaded: LoadedModel, runner: LeaderRunner, resolved: ResolvedConfig,
                 seed: int, group: RankGroup) -> None:
        self._group = group
        super().__init__(loaded, runner, resolved, seed)

    @property
    def rank_group(self) -> RankGroup:
        return self._group

    @property
    def supports_async_scheduling(self) -> bool:
        """No: the follower ranks take each step's inputs from the host (STEP), so an input
        token must be known there before the step starts."""
        return False

    @property
    def tp_size(self) -> int:
        return self._group.tp_size

    def run_kv_ops(self, ops: list[KVRankOp]) -> list:
        """The ops go to the followers as a STEP of ops alone (parallel/messages.py); every
        rank runs them in the same order."""
        with self._group.fatal_on_error("KV rank ops"):
            self._group.send(*pack_kv_ops(encode_ops(ops)))
            return self.rank_kv.run(ops, self._group.control_group)

    def shutdown(self) -> None:
        """Stops the follower ranks and leaves their process group. NCCL's teardown waits for
        the CUDA graphs that captured its collectives, so the graphs go first."""
        self.rank_kv.close()
        self.runner.release_cuda_graphs()
        self._group.shutdown()


def _carry_(input_ids: torch.Tensor, carried: CarriedTokens) -> None:
    """Writes the carried tokens into their rows of input_ids, on the device."""
    if carried.tokens.numel() == input_ids.numel() \
            and carried.rows == carried.sources == list(range(input_ids.numel())):
        input_ids.copy_(carried.tokens)  # the same sequences in the same order: the usual case
        return
    rows = as_device_tensor(carried.rows, torch.long, input_ids.device)
    sources = as_device_tensor(carried.sources, torch.long, input_ids.device)
    input_ids[rows] = carried.tokens[sources]


def build_executor(config: EngineConfig) -> Executor:
    """Loads the model on every rank (starting the follower ranks under TP), sizes and
    allocates the KV cache, captures the decode graphs. ValueError for a model or cache that
    cannot fit; every process started is stopped again when it raises."""
    kernel_options.install(config.kernel_options)  # before any kernel runs or compiles
    hf_config = load_hf_config(config.model)
    check_parallel_fits(hf_config, config.tensor_parallel_size, config.enable_expert_parallel)
    parallel = ParallelContext(0, config.tensor_parallel_size, config.enable_expert_parallel)
    # Followers start first and load their shards while this rank loads its own.
    group = RankGroup(config, rank_device(config.torch_device(), 0)) \
        if parallel.tp_size > 1 else None
    try:
        start = memory_at_start(rank_device(config.torch_device(), 0))
        loaded = load_model(config, parallel, hf_config)
        return _set_up(config, loaded, start, group)
    except BaseException:
        if group is not None:
            group.shutdown()
        raise


def _set_up(config: EngineConfig, loaded: LoadedModel, start: MemoryAtStart | None,
            group: RankGroup | None) -> Executor:
    device = loaded.device
    if device.type == "cuda":
        torch.cuda.set_device(device)  # graph capture and Triton launches below use it
    capture_sizes = default_capture_sizes(config.max_num_seqs) \
        if decode_graphs_possible(config, loaded.model, device) else []
    prefill_tokens = prefill_graph_tokens(config, loaded, capture_sizes, group)
    num_kv_blocks = _resolve_num_kv_blocks(config, loaded, start, capture_sizes, group,
                                           prefill_tokens)
    resolved = ResolvedConfig(
        max_model_len=loaded.max_model_len, num_kv_blocks=num_kv_blocks, dtype=loaded.dtype,
        device=device, vocab_size=loaded.hf_config.vocab_size,
        eos_token_ids=eos_token_ids(config.model,
                                    getattr(loaded.hf_config, "eos_token_id", None)))
    runner = ModelRunner(loaded.model, num_kv_blocks, config.block_size, loaded.dtype, device)
    if group is not None:  # every step (and KV handoff) is mirrored on the follower ranks
        runner = LeaderRunner(runner, group)
    if capture_sizes and group is None:
        runner.enable_cuda_graphs(capture_sizes, loaded.max_model_len, prefill_tokens)
    elif capture_sizes:  # with TP, every rank captures decode graphs (LeaderRunner's)
        runner.enable_cuda_graphs(capture_sizes, loaded.max_model_len)
    if group is None:
        return OneRankExecutor(loaded, runner, resolved, config.seed)
    return MultiRankExecutor(loaded, runner, resolved, config.seed, group)


def decode_graphs_possible(config: EngineConfig, model: nn.Module,
                           device: torch.device) -> bool:
    """Decode graphs on a GPU with the aiter-triton kernels, unless an op cannot replay
    (host-side decisions, e.g. expert parallelism's all-to-all counts). TP ranks capture
    together: the graphs hold their NCCL all-reduces, replayed in step as every rank replays
    the same batch."""
    if device.type != "cuda" or config.enforce_eager or \
            resolve_backend(config.kernels, device.type) is not KernelBackend.AITER_TRITON:
        return False
    blockers = [name for name, m in model.named_modules()
                if not getattr(m, "supports_cuda_graphs", True)]
    if blockers:
        logger.info("decode runs eagerly: %s (and %d more) cannot replay in a CUDA graph",
                    blockers[0], len(blockers) - 1)
    return not blockers


def prefill_graph_tokens(config: EngineConfig, loaded: LoadedModel, capture_sizes: list[int],
                         group: RankGroup | None) -> int:
    """The most new tokens of a one-prompt step that a prefill CUDA graph serves
    (prefill_graphs.py): with decode graphs on one rank and a cache kind the graphs pad
    correctly, config.prefill_graph_tokens capped by the largest step and max_model_len; else
    0 (every prefill eager). TP ranks prefill eagerly: the followers capture what rank 0's
    CAPTURE_GRAPHS command names, the decode sizes only."""
    if not capture_sizes or group is not None \
            or kv_cache_kind(loaded.model) not in PREFILL_GRAPH_KINDS:
        return 0
    return min(config.prefill_graph_tokens, config.max_num_batched_tokens, loaded.max_model_len)


def _resolve_num_kv_blocks(config: EngineConfig, loaded: LoadedModel,
                           start: MemoryAtStart | None, capture_sizes: list[int],
                           group: RankGroup | None, prefill_tokens: int = 0) -> int:
    """Every rank sizes its own cache (memory_profile.py); under TP on GPUs the ranks profile
    together and the smallest count wins (elsewhere the followers take rank 0's)."""
    if group is None or start is None or config.num_kv_blocks is not None:
        size = size_rank_kv_cache(config, loaded, start, capture_sizes, prefill_tokens)
    else:
        own: list[KVCacheSize] = []

        def size_own() -> int:
            own.append(size_rank_kv_cache(config, loaded, start, capture_sizes))
            return own[0].num_blocks

        num_blocks = group.smallest_kv_blocks(size_own, bool(capture_sizes))
        size = dataclasses.replace(own[0], num_blocks=num_blocks)
    logger.info("%s", size.describe())
    return size.num_blocks
