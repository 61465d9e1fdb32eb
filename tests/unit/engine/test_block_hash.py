"""The chained block hash in common/: the router's prefix hashes are the worker's cache keys,
and the block manager tells its listener about every key it gains or loses."""
from __future__ import annotations

from tandem.common.block_hash import PromptBlockHashes, compute_block_hash, prefix_block_hashes
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


def test_prefix_hashes_chain_on_the_blocks_before():
    first = prefix_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert first[0] == compute_block_hash(None, [1, 2, 3, 4])
    assert first[1] == compute_block_hash(first[0], [5, 6, 7, 8])
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


def test_prefix_hashes_equal_the_one_block_hash_chained_at_every_block_size():
    token_ids = [(i * 7919) % 50_000 for i in range(300)]
    for block_size in (1, 4, 16, 32):
        expected, prev_hash = [], None
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            prev_hash = compute_block_hash(prev_hash, token_ids[start:start + block_size])
            expected.append(prev_hash)
        assert prefix_block_hashes(token_ids, block_size) == expected
        assert prefix_block_hashes(token_ids, block_size, max_blocks=5) == expected[:5]
        assert prefix_block_hashes(token_ids, block_size, max_blocks=0) == []


def test_prompt_hashes_are_computed_as_far_as_they_are_read_and_kept():
    token_ids = [(i * 7919) % 50_000 for i in range(400)]
    expected = prefix_block_hashes(token_ids, 4)
    hashes = PromptBlockHashes(token_ids, 4, max_blocks=90)
    assert len(hashes) == 90 and hashes.hashes == []
    assert next(iter(hashes)) == expected[0]
    assert 1 <= len(hashes.hashes) < 20  # one run of blocks, not the prompt
    assert list(zip(range(30), hashes)) == list(enumerate(expected[:30]))
    assert list(hashes) == expected[:90] and hashes.hashes == expected[:90]


def test_a_reset_forgets_every_cached_block_and_tells_the_listener():
    bm = BlockManager(num_blocks=8, block_size=4)
    recorder = Recorder()
    bm.cache_listener = recorder
    done = computed(bm, range(9))  # 2 cached blocks, freed below
    bm.free(done)
    running = computed(bm, range(100, 109))  # 2 cached blocks a live sequence still holds
    assert bm.reset_prefix_cache() == 4
    assert recorder.events[-1] == ("cleared", None) and bm.hash_to_block_id == {}
    bm.check_invariants([running])
    again = Sequence(list(range(9)), SamplingParams())
    bm.allocate(again)
    assert again.num_cached_tokens == 0  # the freed prompt's blocks are gone
    running.num_computed_tokens = running.num_tokens
    bm.check_invariants([running, again])
