"""The engine a worker runs: requests in, one scheduled model step at a time, tokens out.

Used in-process by the offline `tandem.LLM` and, later, behind the worker's gRPC servicer.
Not thread-safe: one thread drives `step()`.
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass

import torch

from tandem.common.checkpoint_files import eos_token_ids
from tandem.common.errors import AlreadyExistsError, OutOfRangeError
from tandem.common.logging import get_logger
from tandem.common.sampling_params import SamplingParams
from tandem.workers.engine.block_manager import BlockManager
from tandem.workers.engine.config import EngineConfig, ResolvedConfig
from tandem.workers.engine.cuda_graphs import default_capture_sizes
from tandem.workers.engine.kv_sizing import KVCacheSize
from tandem.workers.engine.memory_profile import (MemoryAtStart, memory_at_start,
                                                  size_rank_kv_cache)
from tandem.workers.engine.model_runner import ModelRunner
from tandem.workers.engine.model_setup import LoadedModel, load_model
from tandem.workers.engine.sampler import Sampler, advance_request_generator
from tandem.workers.engine.scheduler import Scheduler
from tandem.workers.engine.sequence import FinishReason, Sequence, SequenceStatus
from tandem.workers.engine.stop import check_stop
from tandem.workers.models.loader import load_hf_config
from tandem.workers.ops.backend import KernelBackend, resolve_backend
from tandem.workers.parallel.context import ParallelContext
from tandem.workers.parallel.process_group import rank_device
from tandem.workers.executor.rank_runner import LeaderRunner, RankGroup
from tandem.workers.parallel.validation import check_parallel_fits

logger = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class StepStats:
    """What the last step did (read by the worker's metrics after each step)."""

    num_seqs: int
    num_tokens: int  # tokens whose KV the step computed
    num_prefill_tokens: int  # of those, in prefill (chunk) positions
    num_sampled: int
    is_prefill: bool
    seconds: float


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        started = time.monotonic()
        hf_config = load_hf_config(config.model)
        check_parallel_fits(hf_config, config.tensor_parallel_size,
                            config.enable_expert_parallel)
        parallel = ParallelContext(0, config.tensor_parallel_size,
                                   config.enable_expert_parallel)
        # Followers start first and load their shards while this rank loads its own.
        self.rank_group = RankGroup(config, rank_device(config.torch_device(), 0)) \
            if parallel.tp_size > 1 else None
        try:
            start = memory_at_start(rank_device(config.torch_device(), 0))
            loaded = load_model(config, parallel, hf_config)
            self._set_up(loaded, start)
        except BaseException:
            self.shutdown()
            raise
        logger.info("engine ready in %.1f s: max_model_len=%d, %d KV blocks of %d tokens",
                    time.monotonic() - started, self.resolved.max_model_len,
                    self.resolved.num_kv_blocks, config.block_size)

    def _set_up(self, loaded: LoadedModel, start: MemoryAtStart | None) -> None:
        config, hf_config, dtype, device = self.config, loaded.hf_config, loaded.dtype, \
            loaded.device
        if device.type == "cuda":
            torch.cuda.set_device(device)  # graph capture and Triton launches below use it
        max_model_len = loaded.max_model_len
        self.model = loaded.model
        capture_sizes = default_capture_sizes(config.max_num_seqs) \
            if self._decode_graphs_possible(device) else []
        num_kv_blocks = _resolve_num_kv_blocks(config, loaded, start, capture_sizes,
                                               self.rank_group)
        self.resolved = ResolvedConfig(
            max_model_len=max_model_len, num_kv_blocks=num_kv_blocks, dtype=dtype, device=device,
            vocab_size=hf_config.vocab_size,
            eos_token_ids=eos_token_ids(config.model,
                                        getattr(hf_config, "eos_token_id", None)))
        self.hf_config = hf_config
        self.block_manager = BlockManager(num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens)
        runner = ModelRunner(self.model, num_kv_blocks, config.block_size, dtype, device)
        # With TP, rank 0's runner mirrors every step (and KV handoff) on the follower ranks.
        self.runner = runner if self.rank_group is None else LeaderRunner(runner,
                                                                          self.rank_group)
        if capture_sizes:  # with TP, every rank captures (in step)
            self.runner.enable_cuda_graphs(capture_sizes, max_model_len)
        self.sampler = Sampler(self.resolved.eos_token_ids, seed=config.seed)
        self.requests: dict[str, Sequence] = {}  # every unfinished request, pinned ones included
        self.pinned: dict[str, float] = {}  # request id -> lease deadline (time.monotonic())
        self.num_expired_leases = 0
        # Requests ended here, by status: a finish reason, "abort", or "pinned" (handed off).
        self.num_finished: Counter[str] = Counter()
        self.last_step: StepStats | None = None

    def shutdown(self) -> None:
        """Stop the follower ranks and leave their process group (TP); nothing to do on one
        rank. Idempotent. Call it from the thread that drove the engine, after its last step."""
        if self.rank_group is not None:
            # NCCL's teardown waits for the CUDA graphs that captured its collectives (it hung
            # in destroy_process_group with them alive, on 2 H200s): free them first. No
            # runner yet: set-up failed (e.g. the KV cache did not fit) before any capture.
            if hasattr(self, "runner"):
                self.runner.release_cuda_graphs()
            self.rank_group.shutdown()

    def _decode_graphs_possible(self, device: torch.device) -> bool:
        """Decode graphs on a GPU with the aiter-triton kernels, unless an op cannot replay
        (host-side decisions, e.g. expert parallelism's all-to-all counts). TP ranks capture
        together: the graphs hold their NCCL all-reduces, replayed in step as every rank
        replays the same batch."""
        config = self.config
        if device.type != "cuda" or config.enforce_eager or \
                resolve_backend(config.kernels, device.type) is not KernelBackend.AITER_TRITON:
            return False
        blockers = [name for name, m in self.model.named_modules()
                    if not getattr(m, "supports_cuda_graphs", True)]
        if blockers:
            logger.info("decode runs eagerly: %s (and %d more) cannot replay in a CUDA graph",
                        blockers[0], len(blockers) - 1)
        return not blockers

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, *, pin_after_prefill: bool = False,
                    deadline: float | None = None) -> Sequence:
        """Queue a request; ValueError (naming the problem) if it can never run.

        With pin_after_prefill the request stops after its first token and, unless that token
        finished it, keeps its prompt's KV blocks (status PINNED) until `release` or a lease
        expiry: a decode worker pulls them meanwhile. Once `deadline` (time.monotonic()) has
        passed, the request is dropped before the next step (`_drop_past_deadline`).
        """
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("prompt is empty")
        if num_prompt >= self.resolved.max_model_len:
            raise OutOfRangeError(f"prompt has {num_prompt} tokens; max_model_len="
                             f"{self.resolved.max_model_len} leaves no room to generate")
        self._check_vocabulary(prompt_token_ids, "prompt")
        if request_id is not None and request_id in self.requests:
            raise AlreadyExistsError(f"request_id {request_id!r} is already in use")
        seq = Sequence(prompt_token_ids, params, request_id)
        seq.pin_after_prefill = pin_after_prefill
        seq.deadline = deadline
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def resume_request(self, prompt_token_ids: list[int], generated_token_ids: list[int],
                       params: SamplingParams, request_id: str, *,
                       deadline: float | None = None) -> Sequence:
        """Queue a request that another worker started and could not finish (migration).

        The tokens it generated there join the sequence as completion tokens, and their KV is
        computed here with the prompt's, as after a preemption. So max_tokens, min_tokens,
        penalties, stop checks and a seeded request's random stream (its earlier draws are
        consumed) go on exactly as if one engine had run the whole request.
        """
        num_total = len(prompt_token_ids) + len(generated_token_ids)
        if num_total >= self.resolved.max_model_len:
            raise OutOfRangeError(f"prompt and generated tokens come to {num_total}; "
                                  f"max_model_len={self.resolved.max_model_len} leaves no room "
                                  "to generate")
        if len(generated_token_ids) >= params.max_tokens:
            raise OutOfRangeError(f"{len(generated_token_ids)} generated tokens already reach "
                                  f"max_tokens={params.max_tokens}")
        self._check_vocabulary(generated_token_ids, "generated")
        seq = self.add_request(prompt_token_ids, params, request_id, deadline=deadline)
        seq.token_ids.extend(generated_token_ids)  # still WAITING: no blocks yet
        advance_request_generator(seq, len(generated_token_ids), self.resolved.vocab_size,
                                  self.resolved.device)
        return seq

    def _check_vocabulary(self, token_ids: list[int], what: str) -> None:
        """OutOfRangeError naming the first id outside the vocabulary."""
        vocab = self.resolved.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise OutOfRangeError(f"{what} token id {bad[0]} is outside the vocabulary "
                                  f"[0, {vocab})")

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is (queued, running, pinned, receiving KV) and free its
        blocks; False if it is unknown or already finished."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        was_pinned = self.pinned.pop(request_id, None) is not None
        self.scheduler.finish(seq, FinishReason.ABORT)
        if not was_pinned:  # a pinned request was already counted as handed off
            self.num_finished["abort"] += 1
        return True

    # -- disaggregation: the prefill side pins, the decode side receives ----------------------

    def release(self, request_id: str) -> bool:
        """Unpin a prefilled request's blocks (its decode worker has them now)."""
        if request_id not in self.pinned:
            return False
        del self.pinned[request_id]
        seq = self.requests.pop(request_id)
        self.scheduler.finish(seq, FinishReason.STOP)
        return True

    def expire_leases(self, now: float) -> list[str]:
        """Free pinned requests whose lease deadline passed; returns their ids."""
        expired = [rid for rid, deadline in self.pinned.items() if deadline <= now]
        for request_id in expired:
            self.release(request_id)
        self.num_expired_leases += len(expired)
        return expired

    def reserve_prefilled(self, prompt_token_ids: list[int], generated_token_ids: list[int],
                          params: SamplingParams, request_id: str,
                          deadline: float | None = None) -> Sequence | None:
        """Allocate blocks for a request prefilled elsewhere, so its KV can be written into them.

        Returns None when the blocks are not free now (retry later). The sequence is outside
        the scheduler (status RECEIVING) until `activate_prefilled`; its leading
        `seq.num_cached_tokens` tokens were found in the local prefix cache and need no pull.
        """
        if not generated_token_ids:
            raise ValueError("a prefilled request needs its first generated token")
        seq = self.add_request(prompt_token_ids, params, request_id, deadline=deadline)
        self.scheduler.waiting.remove(seq)
        seq.token_ids.extend(generated_token_ids)
        if not self.block_manager.can_allocate(seq):
            self.requests.pop(seq.request_id)
            return None
        self.block_manager.allocate(seq)
        seq.num_prefix_hit_tokens = seq.num_cached_tokens
        seq.status = SequenceStatus.RECEIVING
        advance_request_generator(seq, len(generated_token_ids), self.resolved.vocab_size,
                                  self.resolved.device)
        return seq

    def activate_prefilled(self, seq: Sequence, num_computed_tokens: int) -> None:
        """The KV of the first num_computed_tokens tokens is in seq's blocks: start decoding."""
        if seq.status is not SequenceStatus.RECEIVING:
            raise RuntimeError(f"activate_prefilled: {seq} is not receiving")
        if not seq.num_cached_tokens <= num_computed_tokens < seq.num_tokens:
            raise ValueError(f"num_computed_tokens={num_computed_tokens} outside "
                             f"[{seq.num_cached_tokens}, {seq.num_tokens})")
        seq.num_computed_tokens = num_computed_tokens
        seq.first_token_time = time.monotonic()  # its first token came from the prefill worker
        self.block_manager.cache_computed_blocks(seq)
        self.scheduler.admit_running(seq)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[Sequence]:
        """Run one model step; returns the sequences that got a token (finished ones included)."""
        started = time.monotonic()
        if self.resolved.device.type == "cuda":
            # Triton launches on the thread's current device, which is per thread and may be
            # another GPU (a worker's engine thread starts on cuda:0; a test may have moved it).
            torch.cuda.set_device(self.resolved.device)
        self._drop_past_deadline(started)
        batch = self.scheduler.schedule()
        if not batch.scheduled:
            if self.scheduler.has_unfinished:
                raise RuntimeError("scheduler made no progress with requests pending")
            return []
        logits = self.runner.run(batch)  # [N, V] for the sampled sequences
        sampled = [item.seq for item in batch.scheduled if item.is_sampled]
        output = self.sampler(logits, sampled) if sampled else None
        for item in batch.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_computed_blocks(item.seq)
        self.last_step = StepStats(
            len(batch.scheduled), batch.num_tokens,
            batch.num_tokens if batch.is_prefill else 0,  # steps are all-prefill or all-decode
            len(sampled), batch.is_prefill, time.monotonic() - started)
        if output is None:
            return []
        now = time.monotonic()
        for seq, token_id, logprob in zip(sampled, output.token_ids, output.logprobs):
            seq.append_token(token_id)
            if logprob is not None:
                seq.logprobs.append(logprob)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = check_stop(seq, self.resolved.eos_token_ids, self.resolved.max_model_len)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self.requests.pop(seq.request_id, None)
                self.num_finished[reason.value] += 1
            elif seq.pin_after_prefill:
                self.scheduler.pin(seq)
                self.pinned[seq.request_id] = now + self.config.kv_lease_seconds
                self.num_finished["pinned"] += 1
        return sampled

    def _drop_past_deadline(self, now: float) -> None:
        """Abort queued and running requests whose deadline has passed: nobody waits for their
        tokens, and a long prompt's remaining chunks would hold the engine for nothing. Pinned
        and receiving requests are not scheduled; their leases and handlers end them."""
        expired = [seq for seq in (*self.scheduler.waiting, *self.scheduler.running)
                   if seq.deadline is not None and seq.deadline <= now]
        for seq in expired:
            logger.warning("dropped request %s: its deadline passed %.1f s ago (%d of %d prompt "
                           "tokens computed, %d generated)", seq.request_id, now - seq.deadline,
                           min(seq.num_computed_tokens, seq.num_prompt_tokens),
                           seq.num_prompt_tokens, seq.num_completion_tokens)
            self.requests.pop(seq.request_id, None)
            self.scheduler.finish(seq, FinishReason.ABORT)
            self.num_finished["deadline"] += 1


def _resolve_num_kv_blocks(config: EngineConfig, loaded: LoadedModel,
                           start: MemoryAtStart | None, capture_sizes: list[int],
                           rank_group: RankGroup | None) -> int:
    """Every rank sizes its own cache (memory_profile.py); under TP on GPUs the ranks profile
    together and the smallest count wins (elsewhere the followers take rank 0's)."""
    if rank_group is None or start is None or config.num_kv_blocks is not None:
        size = size_rank_kv_cache(config, loaded, start, capture_sizes)
    else:
        own: list[KVCacheSize] = []

        def size_own() -> int:
            own.append(size_rank_kv_cache(config, loaded, start, capture_sizes))
            return own[0].num_blocks

        num_blocks = rank_group.smallest_kv_blocks(size_own, bool(capture_sizes))
        size = dataclasses.replace(own[0], num_blocks=num_blocks)
    logger.info("%s", size.describe())
    return size.num_blocks
