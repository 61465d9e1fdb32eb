"""The engine a worker runs: requests in, one scheduled model step at a time, tokens out.

Used in-process by the offline `tandem.LLM` and behind the worker's gRPC servicer.
Not thread-safe: one thread drives `step()`.

Asynchronous scheduling (on by default for a one-rank GPU engine): while decode step N runs on
the device, `step()` schedules and queues step N+1, whose input tokens are step N's samples
read on the device, and only then waits for step N's tokens and does its host work (stop
checks, delivery, metrics) while step N+1 runs. The device never waits for the host between
decode steps. A token in flight is a placeholder in its sequence (sequence.py); stop checks see
it one step later, so a sequence that stopped at step N also computed step N+1, whose token is
dropped. Blocks of a sequence that ends while a queued step may still write them are freed
once that step is done. Steps that need the host in between run as before, one at a time:
prefill chunks, penalized rows, preemption, tensor parallelism. A step with
grammar-constrained rows queues its forward pass ahead and its sampling once step N's tokens
have advanced the grammars (the masks are filled while the forward pass runs).
"""
from __future__ import annotations

import concurrent.futures
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from tandem.common.errors import AlreadyExistsError, OutOfRangeError
from tandem.common.logging import get_logger
from tandem.common.sampling_params import SamplingParams
from tandem.workers.engine.block_manager import BlockManager
from tandem.workers.engine.config import EngineConfig
from tandem.workers.engine.grammar_cache import GrammarCompiler
from tandem.workers.engine.grammar_mask import RequestGrammar
from tandem.workers.engine.sampler import DeviceSample, Sampler, advance_request_generator
from tandem.workers.engine.scheduler import Scheduler, SchedulerOutput
from tandem.workers.engine.sequence import FinishReason, Sequence, SequenceStatus
from tandem.workers.engine.stop import check_stop
from tandem.workers.executor.executor import CarriedTokens, Executor

logger = get_logger(__name__)
# The longest a step with only grammar-waiting requests sleeps for a compile to finish.
MAX_GRAMMAR_WAIT_SECONDS = 0.05


@dataclass(frozen=True, slots=True)
class StepStats:
    """What the last step did (read by the worker's metrics after each step)."""

    num_seqs: int
    num_tokens: int  # tokens whose KV the step computed
    num_prefill_tokens: int  # of those, in prefill (chunk) positions
    num_sampled: int
    is_prefill: bool
    seconds: float


@dataclass(slots=True)
class InFlightStep:
    """A decode step queued on the device whose sampled tokens the host has not read yet."""

    seqs: list[Sequence]  # one per row, every one sampled
    placeholders: list[int]  # per row: the index in seq.token_ids of its in-flight token
    # The queued sampling; None while it waits for the previous step's tokens (`logits` set).
    launched: DeviceSample | None
    logits: torch.Tensor | None
    rows: dict[int, int]  # seq_id -> row
    # Sequences that ended while this step was queued: their blocks are freed once it is done.
    deferred_free: list[Sequence] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        """executor: built for this config (executor.build_executor), which loaded the model
        and allocated its KV cache; the engine steps it and shuts it down."""
        self.config = config
        self.executor = executor
        self.resolved = executor.resolved
        self.model = executor.model
        self.hf_config = executor.hf_config
        self.block_manager = BlockManager(self.resolved.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens)
        self.requests: dict[str, Sequence] = {}  # every unfinished request, pinned ones included
        # Structured output: grammars compile on their own threads; a request whose grammar is
        # still compiling waits here, outside the scheduler, so it holds no batch slot.
        self.grammars = GrammarCompiler(config.model, self.resolved.vocab_size,
                                        self.resolved.eos_token_ids)
        self.awaiting_grammar: list[Sequence] = []
        self.num_constrained_requests = 0
        self.pinned: dict[str, float] = {}  # request id -> lease deadline (time.monotonic())
        self.num_expired_leases = 0
        # Requests ended here, by status: a finish reason, "abort", or "pinned" (handed off).
        self.num_finished: Counter[str] = Counter()
        self.last_step: StepStats | None = None  # None when the last step() read no tokens
        self.async_scheduling = self._resolve_async_scheduling(config.async_scheduling)
        self._in_flight: InFlightStep | None = None
        logger.info("engine ready: max_model_len=%d, %d KV blocks of %d tokens, asynchronous "
                    "scheduling %s", self.resolved.max_model_len, self.resolved.num_kv_blocks,
                    config.block_size, "on" if self.async_scheduling else "off")

    def _resolve_async_scheduling(self, wanted: bool | None) -> bool:
        """None: on for a one-rank GPU engine (on CPU the host runs the model too, so there is
        nothing to overlap)."""
        if wanted is False:
            return False
        if not self.executor.supports_async_scheduling:
            if wanted:
                logger.warning("asynchronous scheduling needs a one-rank engine; with "
                               "tensor_parallel_size=%d every step runs synchronously",
                               self.executor.tp_size)
            return False
        return bool(wanted) or self.resolved.device.type == "cuda"

    @property
    def runner(self):
        """The executor's model runner: its KV cache (`kv_caches`) and decode graphs."""
        return self.executor.runner

    def shutdown(self) -> None:
        """Shut the executor down (TP: stop the follower ranks). Idempotent. Call it from the
        thread that drove the engine, after its last step."""
        self.grammars.shutdown()
        self.executor.shutdown()

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, *, pin_after_prefill: bool = False,
                    deadline: float | None = None) -> Sequence:
        """Queue a request; ValueError (naming the problem) if it can never run.

        With pin_after_prefill the request stops after its first token and, unless that token
        finished it, keeps its prompt's KV blocks (status PINNED) until `release` or a lease
        expiry: a decode worker pulls them meanwhile. Once `deadline` (time.monotonic()) has
        passed, the request is dropped before the next step (`_drop_past_deadline`).

        A request with params.structured_output joins the queue once its grammar has
        compiled (`seq.grammar.compiled`, a future callers may await for a compile error);
        a grammar that fails to compile ends it (ABORT) unless the failure is already known,
        which raises ValueError here.
        """
        seq = self._new_sequence(prompt_token_ids, params, request_id, deadline)
        seq.pin_after_prefill = pin_after_prefill
        self._attach_grammar(seq)
        self.requests[seq.request_id] = seq
        if seq.grammar is not None and not seq.grammar.is_ready:
            self.awaiting_grammar.append(seq)
        else:
            self.scheduler.add(seq)
        return seq

    def _new_sequence(self, prompt_token_ids: list[int], params: SamplingParams,
                      request_id: str | None, deadline: float | None) -> Sequence:
        """A sequence for a request that can run here (not yet registered or queued)."""
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
        seq.deadline = deadline
        return seq

    def _attach_grammar(self, seq: Sequence) -> None:
        """Start (or share) the compile of a constrained request's grammar; ValueError when
        it is already known not to compile."""
        spec = seq.sampling_params.structured_output
        if spec is None:
            return
        seq.grammar = RequestGrammar(self.grammars.compile(spec))
        failure = seq.grammar.failure()
        if failure is not None:
            raise ValueError(failure)
        self.num_constrained_requests += 1

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
        if seq in self.awaiting_grammar:
            self.awaiting_grammar.remove(seq)
        self._end(seq, FinishReason.ABORT)
        if not was_pinned:  # a pinned request was already counted as handed off
            self.num_finished["abort"] += 1
        return True

    # -- disaggregation: the prefill side pins, the decode side receives ----------------------

    def renew_lease(self, request_id: str) -> list[int] | None:
        """Extend a pinned request's lease to kv_lease_seconds from now (never shortening
        it); the blocks holding its prompt's KV, or None when it is not pinned (unknown,
        released or expired)."""
        if request_id not in self.pinned:
            return None
        self.pinned[request_id] = max(self.pinned[request_id],
                                      time.monotonic() + self.config.kv_lease_seconds)
        seq = self.requests[request_id]
        num_prompt_blocks = -(-seq.num_computed_tokens // self.config.block_size)
        return list(seq.block_table[:num_prompt_blocks])

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

    def queue_prefilled(self, prompt_token_ids: list[int], generated_token_ids: list[int],
                        params: SamplingParams, request_id: str,
                        deadline: float | None = None) -> Sequence:
        """Queue a request prefilled elsewhere until blocks are free to write its KV into
        (status WAITING_FOR_REMOTE_KVS, outside scheduling). `reserve_remote` allocates them,
        in queue order, and the sequence becomes RECEIVING until `activate_prefilled`; its
        leading `seq.num_cached_tokens` tokens were found in the local prefix cache and need no
        pull. abort() takes it out of the queue like any request. A constrained request's
        first decode step waits for its grammar: callers await `seq.grammar.compiled` before
        activating it."""
        seq = self._prefilled_sequence(prompt_token_ids, generated_token_ids, params,
                                       request_id, deadline)
        self._queue_remote(seq)
        return seq

    def reserve_remote(self) -> list[Sequence]:
        """Blocks for the queued prefilled requests that fit now, in queue order; the ones
        that got them (RECEIVING)."""
        return self.scheduler.reserve_remote()

    def reserve_prefilled(self, prompt_token_ids: list[int], generated_token_ids: list[int],
                          params: SamplingParams, request_id: str,
                          deadline: float | None = None) -> Sequence | None:
        """queue_prefilled and reserve_remote at once, for a caller that drives the engine
        itself: the sequence, RECEIVING, or None (nothing kept, nothing counted) when its
        blocks are not free now or other prefilled requests wait before it."""
        if self.scheduler.waiting_for_remote_kvs:
            return None
        seq = self._prefilled_sequence(prompt_token_ids, generated_token_ids, params,
                                       request_id, deadline)
        if not self.block_manager.can_allocate(seq):
            return None
        self._queue_remote(seq)
        reserved = self.reserve_remote()
        assert reserved == [seq], "an empty queue's only request fits: checked above"
        return seq

    def _prefilled_sequence(self, prompt_token_ids: list[int], generated_token_ids: list[int],
                            params: SamplingParams, request_id: str,
                            deadline: float | None) -> Sequence:
        if not generated_token_ids:
            raise ValueError("a prefilled request needs its first generated token")
        seq = self._new_sequence(prompt_token_ids, params, request_id, deadline)
        seq.token_ids.extend(generated_token_ids)
        return seq

    def _queue_remote(self, seq: Sequence) -> None:
        self._attach_grammar(seq)
        self.requests[seq.request_id] = seq
        advance_request_generator(seq, seq.num_completion_tokens, self.resolved.vocab_size,
                                  self.resolved.device)
        self.scheduler.add_remote(seq)

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
        return self.scheduler.has_unfinished or bool(self.awaiting_grammar) \
            or self._in_flight is not None

    def step(self) -> list[Sequence]:
        """Run one model step; returns the sequences that got a token (finished ones included).

        Under asynchronous scheduling a call may queue a decode step and return before its
        tokens are known ([]: the next call returns them), and a call that returns a step's
        tokens may already have queued the next one."""
        started = time.monotonic()
        self.last_step = None
        if self.resolved.device.type == "cuda":
            # Triton launches on the thread's current device, which is per thread and may be
            # another GPU (a worker's engine thread starts on cuda:0; a test may have moved it).
            torch.cuda.set_device(self.resolved.device)
        self._drop_past_deadline(started)
        self._admit_compiled_grammars()
        try:
            return self._step(started)
        except BaseException:
            self._abandon_in_flight()
            raise

    def _step(self, started: float) -> list[Sequence]:
        previous = self._in_flight
        if previous is not None:
            self._in_flight = None
            if self._can_launch_ahead():
                batch = self.scheduler.schedule()
                assert not batch.is_prefill and not batch.preempted, "checked: decode only"
                self._in_flight = self._launch(batch, previous)
            done = self._complete(previous, started)
            if self._in_flight is not None:
                self._sample_queued(self._in_flight)
            return done
        batch = self.scheduler.schedule()
        if not batch.scheduled:
            if self.scheduler.has_unfinished:
                raise RuntimeError("scheduler made no progress with requests pending")
            if self.awaiting_grammar:  # nothing else to do: give the compiles a moment
                concurrent.futures.wait([seq.grammar.compiled for seq in self.awaiting_grammar],
                                        MAX_GRAMMAR_WAIT_SECONDS,
                                        concurrent.futures.FIRST_COMPLETED)
            return []
        if self.async_scheduling and not batch.is_prefill \
                and all(self._samples_on_device(item.seq) for item in batch.scheduled):
            self._in_flight = self._launch(batch, None)
            return []
        return self._run(batch, started)

    def _run(self, batch: SchedulerOutput, started: float) -> list[Sequence]:
        """One step, synchronously: run it, then read and handle its tokens. The blocks the
        step fills are hashed while the device runs it, and registered once it has."""
        hash_ahead = (lambda: self._hash_ahead(batch)) \
            if self.block_manager.enable_prefix_caching else None  # nothing to hash without
        output = self.executor.execute(batch, hash_ahead)
        sampled = [item.seq for item in batch.scheduled if item.is_sampled]
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
            self._handle_token(seq, token_id, now)
        return sampled

    def _hash_ahead(self, batch: SchedulerOutput) -> None:
        for item in batch.scheduled:
            self.block_manager.hash_ahead(item.seq,
                                          item.seq.num_computed_tokens + item.num_new_tokens)

    # -- asynchronous scheduling -------------------------------------------------------------

    def _samples_on_device(self, seq: Sequence) -> bool:
        """Whether the sequence's next token may be sampled without the host in between."""
        return Sampler.samples_on_device(seq) and not seq.pin_after_prefill

    def _can_launch_ahead(self) -> bool:
        """Whether the next step can be queued before the in-flight one's tokens are read: it
        is a decode step of the running sequences (no waiting request can be admitted now, so
        the scheduler schedules no prefill), it needs no preemption (each sequence may need one
        more block), and every row samples on the device."""
        scheduler, running = self.scheduler, self.scheduler.running
        if not running or self.block_manager.num_free_blocks < len(running):
            return False
        if scheduler.waiting and len(running) < scheduler.max_num_seqs \
                and self.block_manager.can_allocate(scheduler.waiting[0]):
            return False
        return all(seq.num_computed_tokens > 0 and seq.num_uncomputed_tokens == 1
                   and self._samples_on_device(seq) for seq in running)

    def _launch(self, batch: SchedulerOutput, previous: InFlightStep | None) -> InFlightStep:
        """Queue a decode step on the device; each sequence gets a placeholder for its token.
        A sequence whose input token is still in flight (in `previous`) reads it there."""
        seqs = [item.seq for item in batch.scheduled]
        carried = None
        if previous is not None:
            rows = [row for row, seq in enumerate(seqs) if seq.num_inflight_tokens]
            if rows:
                carried = CarriedTokens(previous.launched.token_ids, rows,
                                        [previous.rows[seqs[row].seq_id] for row in rows])
        logits = self.executor.launch_forward(batch, carried)
        placeholders = []
        for seq in seqs:
            seq.num_computed_tokens += 1
            placeholders.append(seq.append_placeholder())
        step = InFlightStep(seqs, placeholders, None, logits,
                            {seq.seq_id: row for row, seq in enumerate(seqs)})
        # A grammar's mask needs every token before the row's input token on the host: with
        # a step in flight, the sampling waits until that step's tokens are read
        # (`_sample_queued`), while the forward pass runs.
        if previous is None or all(seq.grammar is None for seq in seqs):
            self._sample_queued(step)
        return step

    def _sample_queued(self, step: InFlightStep) -> None:
        """Queue the sampling of a step whose forward pass is queued."""
        if step.launched is None:
            step.launched = self.executor.launch_sample(step.logits, step.seqs)
            step.logits = None

    def _complete(self, step: InFlightStep, started: float) -> list[Sequence]:
        """Wait for a queued step's tokens and handle them, as `_run` does after its step."""
        self._sample_queued(step)
        output = step.launched.to_host()
        for seq in step.deferred_free:
            self.block_manager.free(seq)
        now = time.monotonic()
        done = []
        for seq, index, token_id, logprob in zip(step.seqs, step.placeholders,
                                                 output.token_ids, output.logprobs):
            if seq.is_finished:  # ended while its token was in flight: the token is dropped
                continue
            seq.fill_placeholder(index, token_id)
            if logprob is not None:
                seq.logprobs.append(logprob)
            # Only now is every computed position's token known (hashes cover token ids).
            self.block_manager.cache_computed_blocks(seq)
            self._handle_token(seq, token_id, now)
            done.append(seq)
        num_rows = len(step.seqs)
        self.last_step = StepStats(num_rows, num_rows, 0, num_rows, False, now - started)
        return done

    def wait_in_flight(self) -> list[Sequence]:
        """Read and handle the queued step's tokens, if a step is queued, without queueing
        another: afterwards no token is in flight (a benchmark then times one step alone)."""
        step, self._in_flight = self._in_flight, None
        return [] if step is None else self._complete(step, time.monotonic())

    def _abandon_in_flight(self) -> None:
        """After a failed step: wait for the queued step, if any, and free what it deferred.
        Its sequences keep their placeholders until they are ended (the caller aborts them)."""
        step, self._in_flight = self._in_flight, None
        if step is None:
            return
        try:
            if step.launched is not None:
                step.launched.to_host()
        except Exception:  # the device may be what failed: the blocks are freed regardless
            logger.exception("could not wait for the queued step")
        for seq in step.deferred_free:
            self.block_manager.free(seq)

    # -- every step ----------------------------------------------------------------------------

    def _handle_token(self, seq: Sequence, token_id: int, now: float) -> None:
        """A sampled token's id has reached the host: record it, check whether it ends the
        request, and pin a finished prefill's blocks for its decode worker."""
        if seq.first_token_time is None:
            seq.first_token_time = now
        if seq.grammar is not None and seq.grammar.accept(token_id):
            reason = FinishReason.STOP  # the output is complete
        else:
            reason = check_stop(seq, self.resolved.eos_token_ids, self.resolved.max_model_len)
        if reason is not None:
            self._end(seq, reason)
            self.requests.pop(seq.request_id, None)
            self.num_finished[reason.value] += 1
        elif seq.pin_after_prefill:
            self.scheduler.pin(seq)
            self.pinned[seq.request_id] = now + self.config.kv_lease_seconds
            self.num_finished["pinned"] += 1

    def _end(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish a sequence wherever it is. Its blocks are freed now, or, while a queued step
        may still write them, once that step is done; its in-flight tokens are dropped."""
        seq.drop_placeholders()
        step = self._in_flight
        holds_blocks = step is not None and seq.seq_id in step.rows
        self.scheduler.finish(seq, reason, free_blocks=not holds_blocks)
        if holds_blocks:
            step.deferred_free.append(seq)

    def _admit_compiled_grammars(self) -> None:
        """Queue the requests whose grammar finished compiling; end those it failed for."""
        if not self.awaiting_grammar:
            return
        still_compiling = []
        for seq in self.awaiting_grammar:
            if not seq.grammar.is_ready:
                still_compiling.append(seq)
                continue
            failure = seq.grammar.failure()
            if failure is None:
                self.scheduler.add(seq)
                continue
            logger.warning("request %s: %s", seq.request_id, failure)
            self.requests.pop(seq.request_id, None)
            self._end(seq, FinishReason.ABORT)
            self.num_finished["abort"] += 1
        self.awaiting_grammar = still_compiling

    def _drop_past_deadline(self, now: float) -> None:
        """Abort queued and running requests whose deadline has passed: nobody waits for their
        tokens, and a long prompt's remaining chunks would hold the engine for nothing. Pinned
        and receiving requests are not scheduled; their leases and handlers end them."""
        expired = [seq for seq in (*self.scheduler.waiting, *self.scheduler.running,
                                   *self.awaiting_grammar)
                   if seq.deadline is not None and seq.deadline <= now]
        for seq in expired:
            logger.warning("dropped request %s: its deadline passed %.1f s ago (%d of %d prompt "
                           "tokens computed, %d generated)", seq.request_id, now - seq.deadline,
                           min(seq.num_computed_tokens, seq.num_prompt_tokens),
                           seq.num_prompt_tokens, seq.num_completion_tokens)
            self.requests.pop(seq.request_id, None)
            if seq in self.awaiting_grammar:
                self.awaiting_grammar.remove(seq)
            self._end(seq, FinishReason.ABORT)
            self.num_finished["deadline"] += 1
