"""Prefill-first continuous batching with chunked prefill and preemption by recompute.

Each step is either a prefill step (prompt chunks, up to max_num_batched_tokens tokens) or a
decode step (one token for every running sequence that has finished its prefill):

  1. Sequences part-way through their prefill continue first, then waiting sequences are
     admitted (FIFO) while blocks, the token budget and max_num_seqs allow. A prompt longer
     than the remaining budget gets a chunk now and the rest in later steps.
  2. Only when no prefill work was scheduled: every running sequence decodes one token. If the
     block pool is exhausted, the most recently admitted sequence is preempted: its blocks are
     freed and it goes back to the front of the queue to be recomputed (prompt + completion).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tandem.workers.engine.block_manager import BlockManager
from tandem.workers.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens whose KV this step computes, from seq.num_computed_tokens on
    is_sampled: bool  # True when this step reaches the sequence's last token: sample after it


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    is_prefill: bool
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()  # admission order
        # prefilled elsewhere, waiting for blocks to receive their KV into (FIFO; never
        # scheduled: reserve_remote moves them to RECEIVING, outside the scheduler)
        self.waiting_for_remote_kvs: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        prefills = self._schedule_prefills()
        if prefills:
            return SchedulerOutput(prefills, is_prefill=True)
        decodes, preempted = self._schedule_decodes()
        return SchedulerOutput(decodes, is_prefill=False, preempted=preempted)

    def _schedule_prefills(self) -> list[ScheduledSequence]:
        budget = self.max_num_batched_tokens
        scheduled = []
        for seq in self.running:
            if budget == 0:
                return scheduled
            if seq.num_uncomputed_tokens > 1 or seq.num_computed_tokens == 0:
                budget -= self._add_chunk(scheduled, seq, budget)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.num_prefix_hit_tokens = seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            budget -= self._add_chunk(scheduled, seq, budget)
        return scheduled

    @staticmethod
    def _add_chunk(scheduled: list[ScheduledSequence], seq: Sequence, budget: int) -> int:
        num_new = min(seq.num_uncomputed_tokens, budget)
        is_sampled = seq.num_computed_tokens + num_new == seq.num_tokens
        scheduled.append(ScheduledSequence(seq, num_new, is_sampled))
        return num_new

    def _schedule_decodes(self) -> tuple[list[ScheduledSequence], list[Sequence]]:
        scheduled, preempted = [], []
        queue = list(self.running)
        kept: list[Sequence] = []
        while queue:
            seq = queue.pop(0)
            while not self.block_manager.can_append_slots(seq, 1):
                victim = queue.pop() if queue else seq  # the latest admitted goes first
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.append_slots(seq, 1)
                scheduled.append(ScheduledSequence(seq, 1, True))
                kept.append(seq)
        self.running = deque(kept)
        return scheduled, preempted

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def add_remote(self, seq: Sequence) -> None:
        """Queue a sequence prefilled elsewhere until blocks are free for its KV."""
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote_kvs.append(seq)

    def reserve_remote(self) -> list[Sequence]:
        """Allocate blocks to the queued remote-KV sequences, in order, while they fit; the
        ones that got them (now RECEIVING: their KV may be written)."""
        reserved = []
        queue = self.waiting_for_remote_kvs
        while queue and self.block_manager.can_allocate(queue[0]):
            seq = queue.popleft()
            self.block_manager.allocate(seq)
            seq.num_prefix_hit_tokens = seq.num_cached_tokens
            seq.status = SequenceStatus.RECEIVING
            reserved.append(seq)
        return reserved

    def pin(self, seq: Sequence) -> None:
        """Take a prefilled sequence out of scheduling, keeping its blocks (PINNED)."""
        self.running.remove(seq)
        seq.status = SequenceStatus.PINNED

    def admit_running(self, seq: Sequence) -> None:
        """Add a sequence that already holds blocks with computed KV (received from a peer)."""
        seq.status = SequenceStatus.RUNNING
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: FinishReason, *, free_blocks: bool = True) -> None:
        """Ends a sequence wherever it is (running, waiting) and frees its blocks, unless
        free_blocks is False: a step still running on the device may write them, and the
        caller frees them (block_manager.free) once it is done."""
        if free_blocks:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = time.monotonic()
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.waiting_for_remote_kvs:
            self.waiting_for_remote_kvs.remove(seq)
