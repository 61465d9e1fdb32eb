"""BlockManager under random scheduler-like traffic (hypothesis stateful tests): after every
operation every block is free or referenced, ref counts match owners, cache hits hold the KV
actually written, and freeing everything returns the pool whole."""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tandem.common.sampling_params import SamplingParams
from tandem.workers.engine.block_manager import BlockManager
from tandem.workers.engine.sequence import Sequence, SequenceStatus

# A pool this small (16 token slots) is often nearly full, where the accounting is tightest;
# the longest prompts do not fit at all and stay waiting until aborted.
NUM_BLOCKS, BLOCK_SIZE, VOCAB = 8, 2, 2
# Prompts are a piece of one of two shared stems plus a random tail from a tiny vocab, so
# requests often share prefixes (system-prompt style) and sometimes diverge mid-block.
STEMS = ((0, 1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1), (1, 1, 0, 0, 1, 0, 1, 1))
prompts = st.builds(
    lambda stem, num_stem, tail: [*stem[:num_stem], *tail],
    st.sampled_from(STEMS), st.integers(0, 12),
    st.lists(st.integers(0, VOCAB - 1), max_size=6),
).filter(bool)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random scheduler-like traffic against a small pool, with a shadow of the KV contents.

    The shadow maps each (block, slot) to the token prefix whose KV it holds, so a prefix hit
    can be checked against what was actually "computed" there.
    """

    enable_prefix_caching = True

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, self.enable_prefix_caching)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}

    def _slot(self, seq: Sequence, pos: int) -> tuple[int, int]:
        return seq.block_table[pos // BLOCK_SIZE], pos % BLOCK_SIZE

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        assert seq.block_table == [] and seq.block_hashes == []
        assert seq.num_computed_tokens == seq.num_cached_tokens == 0

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.append(seq)

    def _compute(self, seq: Sequence, num_new: int) -> None:
        """A model step over seq's next num_new tokens: write their KV, then cache full blocks."""
        start = seq.num_computed_tokens
        assert len(seq.block_table) * BLOCK_SIZE >= start + num_new
        if seq.seq_id % 2:  # as the engine does while the device runs a synchronous step
            self.bm.hash_ahead(seq, start + num_new)
        for pos in range(start, start + num_new):
            block = self.bm.blocks[seq.block_table[pos // BLOCK_SIZE]]
            # Writing KV into a shared or findable block would corrupt another request's cache.
            assert block.ref_count == 1 and block.hash is None
            self.kv[self._slot(seq, pos)] = tuple(seq.token_ids[: pos + 1])
        seq.num_computed_tokens += num_new
        self.bm.cache_computed_blocks(seq)
        expected = seq.num_computed_tokens // BLOCK_SIZE if self.enable_prefix_caching else 0
        assert len(seq.block_hashes) == expected

    @precondition(lambda self: len(self.waiting) + len(self.running) < 8)
    @rule(prompt=prompts)
    def add(self, prompt):
        self.waiting.append(Sequence(prompt, SamplingParams()))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def allocate(self, data):
        seq = data.draw(st.sampled_from(self.waiting))
        num_free = self.bm.num_free_blocks
        if not self.bm.can_allocate(seq):
            with pytest.raises(RuntimeError):
                self.bm.allocate(seq)
            assert seq.block_table == [] and self.bm.num_free_blocks == num_free
            return
        self.bm.allocate(seq)  # must not raise: can_allocate said yes
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.status = SequenceStatus.RUNNING
        assert len(seq.block_table) == seq.num_blocks(BLOCK_SIZE)
        assert seq.num_cached_tokens == seq.num_computed_tokens < seq.num_tokens
        assert len(seq.block_hashes) * BLOCK_SIZE == seq.num_cached_tokens
        for pos in range(seq.num_cached_tokens):  # a hit serves exactly the KV computed there
            assert self.kv[self._slot(seq, pos)] == tuple(seq.token_ids[: pos + 1])

    @precondition(lambda self: any(s.num_uncomputed_tokens > 1 for s in self.running))
    @rule(data=st.data())
    def prefill_chunk(self, data):
        seq = data.draw(st.sampled_from([s for s in self.running if s.num_uncomputed_tokens > 1]))
        self._compute(seq, data.draw(st.integers(1, seq.num_uncomputed_tokens - 1)))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, VOCAB - 1))
    def step_and_sample(self, data, token):
        """Compute the rest of a running seq (its last prefill chunk, or one decode token), sample
        a token, and make room for it; preempt the seq when no block is free."""
        seq = data.draw(st.sampled_from(self.running))
        self._compute(seq, seq.num_uncomputed_tokens)
        seq.append_token(token)
        if self.bm.can_append_slots(seq, 1):
            self.bm.append_slots(seq, 1)
            assert len(seq.block_table) * BLOCK_SIZE >= seq.num_tokens
        else:
            with pytest.raises(RuntimeError):
                self.bm.append_slots(seq, 1)
            self._preempt(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        self._preempt(data.draw(st.sampled_from(self.running)))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        seq = data.draw(st.sampled_from(self.running))
        self._release(seq)
        seq.status = SequenceStatus.FINISHED

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data):
        seq = data.draw(st.sampled_from(self.waiting))
        self.waiting.remove(seq)
        self.bm.free(seq)  # holds no blocks: a no-op

    @invariant()
    def accounting_holds(self):
        self.bm.check_invariants(self.running)
        held = {block_id for seq in self.running for block_id in seq.block_table}
        assert self.bm.num_free_blocks + len(held) == NUM_BLOCKS
        assert all(seq.block_table == [] for seq in self.waiting)
        assert 0 <= self.bm.prefix_cache_hits <= self.bm.prefix_cache_queries
        if not self.enable_prefix_caching:
            assert self.bm.hash_to_block_id == {} and self.bm.prefix_cache_queries == 0

    def teardown(self):
        for seq in list(self.running):
            self._release(seq)
        assert self.bm.num_free_blocks == NUM_BLOCKS
        assert all(block.ref_count == 0 for block in self.bm.blocks)
        self.bm.check_invariants([])


class NoPrefixCachingMachine(BlockManagerMachine):
    enable_prefix_caching = False


BlockManagerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None)
NoPrefixCachingMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=50, deadline=None)
TestBlockManagerStateful = BlockManagerMachine.TestCase
TestNoPrefixCachingStateful = NoPrefixCachingMachine.TestCase
