"""The block hash in common/: the router's prefix hashes are the worker's cache keys,
and the block manager tells its listener about every key it gains or loses."""
from __future__ import annotations

import hashlib
import random
import struct

import pytest

from tandem.common.block_hash import BlockHasher, PromptBlockHashes, prefix_block_hashes
from tandem.common.sampling_params import SamplingParams
from tandem.workers.engine.block_manager import BlockManager
from tandem.workers.engine.sequence import Sequence


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def stored(self, block_hash: int) -> None:
        self.events.append(("stored", block_hash))

    def evicted(self, block_hash: int) -> None:
        self.events.append(("evicted", block_hash))

    def cleared(self) -> None:
        self.events.append(("cleared", None))


def computed(bm: BlockManager, token_ids) -> Sequence:
    seq = Sequence(list(token_ids), SamplingParams())
    bm.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq)
    return seq


def test_prefix_hashes_are_the_block_managers_cache_keys():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = computed(bm, range(14))  # 3 full blocks and a partial one
    assert prefix_block_hashes(list(range(14)), 4) == seq.block_hashes
    assert set(bm.hash_to_block_id) == set(seq.block_hashes)
    assert prefix_block_hashes(list(range(14)), 4, max_blocks=2) == seq.block_hashes[:2]
    assert prefix_block_hashes([1, 2, 3], 4) == []


def test_a_block_hash_covers_every_token_up_to_the_blocks_end():
    first = prefix_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    hasher = BlockHasher()
    assert first == [hasher.next_block([1, 2, 3, 4]), hasher.next_block([5, 6, 7, 8])]
    assert first[1] == prefix_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 8)[0]
    assert prefix_block_hashes([0, 0, 0, 0, 5, 6, 7, 8], 4)[1] != first[1]


def test_listener_hears_every_stored_and_evicted_key():
    bm = BlockManager(num_blocks=3, block_size=4)
    recorder = Recorder()
    bm.cache_listener = recorder
    a = computed(bm, range(9))  # 2 full blocks cached, 3 blocks held
    a_hashes = list(a.block_hashes)
    assert recorder.events == [("stored", h) for h in a_hashes]
    bm.free(a)
    recorder.events.clear()
    b = computed(bm, range(100, 109))  # reuses all 3 blocks: both cached keys go
    assert sorted(recorder.events[:2]) == sorted(("evicted", h) for h in a_hashes)
    assert recorder.events[2:] == [("stored", h) for h in b.block_hashes]
    assert set(bm.hash_to_block_id) == set(b.block_hashes)


def test_a_duplicate_block_is_not_stored_twice():
    bm = BlockManager(num_blocks=8, block_size=4)
    recorder = Recorder()
    bm.cache_listener = recorder
    a = Sequence(list(range(5)), SamplingParams())
    b = Sequence(list(range(5)), SamplingParams())
    bm.allocate(a)
    bm.allocate(b)  # nothing cached yet: b computes the same block on its own
    for seq in (a, b):
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_computed_blocks(seq)
    assert recorder.events == [("stored", a.block_hashes[0])]


def test_prefix_hashes_equal_the_block_hasher_at_every_block_size():
    token_ids = [(i * 7919) % 50_000 for i in range(300)]
    for block_size in (1, 4, 16, 32):
        hasher = BlockHasher()
        expected = [hasher.next_block(token_ids[start:start + block_size])
                    for start in range(0, len(token_ids) - block_size + 1, block_size)]
        assert prefix_block_hashes(token_ids, block_size) == expected
        assert prefix_block_hashes(token_ids, block_size, max_blocks=5) == expected[:5]
        assert prefix_block_hashes(token_ids, block_size, max_blocks=0) == []


def test_prompt_hashes_are_probed_in_any_order_and_kept():
    token_ids = [(i * 7919) % 50_000 for i in range(400)]
    expected = prefix_block_hashes(token_ids, 4)
    hashes = PromptBlockHashes(token_ids, 4, max_blocks=90)
    assert len(hashes) == 90 and hashes.probed == {}
    for count in (90, 1, 45, 44, 46, 89, 2, 45):
        assert hashes.hash_of(count) == expected[count - 1]
    assert sorted(hashes.probed) == [1, 2, 44, 45, 46, 89, 90]
    assert [hashes.hash_of(count) for count in range(1, 91)] == expected[:90]
    for count in (0, 91):
        with pytest.raises(IndexError):
            hashes.hash_of(count)


@pytest.mark.parametrize("block_size", [1, 16, 100, 512])
def test_prompt_hashes_cross_the_kept_states_in_any_order(block_size):
    # Long enough that probes start from states kept past the first (every ~2 KiB of ids).
    rng = random.Random(block_size)
    token_ids = [rng.randrange(150_000) for _ in range(max(3000, 12 * block_size) + 5)]
    expected = prefix_block_hashes(token_ids, block_size)
    for _ in range(3):
        hashes = PromptBlockHashes(token_ids, block_size)
        counts = list(range(1, len(expected) + 1))
        rng.shuffle(counts)
        assert [hashes.hash_of(count) for count in counts] == [
            expected[count - 1] for count in counts]
    hashes = PromptBlockHashes(token_ids, block_size, max_blocks=len(expected) - 3)
    assert hashes.hash_of(1) == expected[0]  # packs the first block's ids only, then all
    assert hashes.hash_of(len(expected) - 3) == expected[-4]


def test_a_token_id_hashes_as_its_four_little_endian_bytes():
    token_ids = [0, 1, 50_000, 2**31 - 1, -1, -(2**31)]  # ids below zero take another path
    expected = hashlib.sha256(struct.pack("<6i", *token_ids)).digest()[:8]
    assert BlockHasher().next_block(token_ids) == int.from_bytes(expected, "little")
    hashes = PromptBlockHashes(token_ids + [7], 2)
    assert [hashes.hash_of(count) for count in (3, 1, 2)] == [
        prefix_block_hashes(token_ids, 2)[count - 1] for count in (3, 1, 2)]


def test_a_growing_sequence_hashes_its_new_blocks_as_the_router_does():
    bm = BlockManager(num_blocks=16, block_size=4)
    seq = computed(bm, range(10))
    for token in range(100, 118):  # decode: one token per step, five more blocks filled
        bm.append_slots(seq, 1)
        seq.append_token(token)
        seq.num_computed_tokens = seq.num_tokens - 1  # the newest token's KV comes next step
        bm.cache_computed_blocks(seq)
    assert seq.block_hashes == prefix_block_hashes(seq.token_ids, 4)[:len(seq.block_hashes)]
    assert len(seq.block_hashes) == (seq.num_tokens - 1) // 4
    bm.free(seq)  # preempted: computed again from its cached prefix
    again = computed(bm, seq.token_ids)
    assert again.block_hashes == prefix_block_hashes(seq.token_ids, 4)
    bm.free(again)
    assert bm._running_hashes == {}
