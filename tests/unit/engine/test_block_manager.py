"""BlockManager: unit tests of the allocation contract (the stateful property tests live in
test_block_manager_stateful.py)."""
from __future__ import annotations

import pytest

from tandem.common.block_hash import BlockHasher
from tandem.common.sampling_params import SamplingParams
from tandem.workers.engine.block_manager import BlockManager
from tandem.workers.engine.sequence import Sequence


def make_seq(token_ids) -> Sequence:
    return Sequence(list(token_ids), SamplingParams())


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """Stand-in for a model step that writes the KV of every token of the sequence."""
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq)


def allocate_succeeds(bm: BlockManager, seq: Sequence) -> bool:
    try:
        bm.allocate(seq)
    except RuntimeError:
        return False
    return True


# -- block hashes ------------------------------------------------------------------------------

def test_block_hash_covers_every_token_so_far_and_is_pinned():
    hasher = BlockHasher()
    h0 = hasher.next_block([1, 2, 3, 4])
    # Pinned: the value must not depend on the process (PYTHONHASHSEED) or the Python version.
    assert h0 == BlockHasher().next_block((1, 2, 3, 4)) == 0x5BE059DBEEAD97CF
    assert 0 <= h0 < 2**64
    h1 = hasher.next_block([5, 6, 7, 8])
    assert h1 != BlockHasher().next_block([5, 6, 7, 8])  # the block before counts
    assert h1 == BlockHasher([1, 2, 3, 4]).next_block([5, 6, 7, 8])
    assert h1 == BlockHasher().next_block(range(1, 9))  # whatever the block size
    assert BlockHasher().next_block([1, 2, 3, 5]) != h0


# -- construction ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, name", [
    (dict(num_blocks=0, block_size=4), "num_blocks"),
    (dict(num_blocks=4, block_size=0), "block_size"),
    (dict(num_blocks=4.0, block_size=4), "num_blocks"),
])
def test_bad_constructor_args_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        BlockManager(**kwargs)


# -- allocate / free ---------------------------------------------------------------------------

def test_allocate_free_round_trip():
    bm = BlockManager(num_blocks=10, block_size=4)
    seq = make_seq(range(10))  # 3 blocks, the last one partial
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 3
    assert seq.num_computed_tokens == seq.num_cached_tokens == 0
    assert bm.num_free_blocks == 7
    assert bm.usage == pytest.approx(0.3)
    bm.check_invariants([seq])

    compute_all(bm, seq)
    bm.free(seq)
    assert seq.block_table == [] and seq.block_hashes == []
    assert seq.num_computed_tokens == seq.num_cached_tokens == 0
    assert bm.num_free_blocks == 10 and bm.usage == 0.0
    bm.check_invariants([])
    bm.free(seq)  # an empty table: no-op
    assert bm.num_free_blocks == 10


def test_allocate_twice_raises():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(range(3))
    bm.allocate(seq)
    with pytest.raises(RuntimeError):
        bm.allocate(seq)


def test_out_of_blocks_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    big = make_seq(range(9))  # needs 3 blocks
    assert not bm.can_allocate(big)
    with pytest.raises(RuntimeError, match="free blocks"):
        bm.allocate(big)
    assert big.block_table == [] and bm.num_free_blocks == 2

    seq = make_seq(range(8))  # exactly 2 blocks
    bm.allocate(seq)
    compute_all(bm, seq)
    seq.append_token(0)
    assert not bm.can_append_slots(seq, 1)
    with pytest.raises(RuntimeError, match="free blocks"):
        bm.append_slots(seq, 1)
    assert len(seq.block_table) == 2
    bm.check_invariants([seq])


# -- prefix caching ----------------------------------------------------------------------------

def test_prefix_hit_after_blocks_are_computed():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_seq(range(10))
    bm.allocate(a)
    compute_all(bm, a)
    assert len(a.block_hashes) == 2  # the partial third block is never hashed

    b = make_seq([*range(8), 99, 98, 97])
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] not in a.block_table
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert b.block_hashes == a.block_hashes
    assert bm.blocks[a.block_table[0]].ref_count == 2
    bm.check_invariants([a, b])

    c = make_seq([0, 1, 2, 3, 42, 5, 6, 7, 8])  # shares only the first block
    bm.allocate(c)
    assert c.block_table[0] == a.block_table[0] and c.block_table[1] != a.block_table[1]
    assert c.num_cached_tokens == 4
    bm.check_invariants([a, b, c])


def test_no_hit_before_blocks_are_computed():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_seq(range(10))
    bm.allocate(a)
    b = make_seq(range(10))
    bm.allocate(b)  # a's KV is not written yet: nothing to share
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)

    a.num_computed_tokens = 6  # a chunk: only the first block is full and computed
    bm.cache_computed_blocks(a)
    assert len(a.block_hashes) == 1
    c = make_seq(range(10))
    bm.allocate(c)
    assert c.num_cached_tokens == 4 and c.block_table[0] == a.block_table[0]
    assert c.block_table[1] != a.block_table[1]
    bm.check_invariants([a, b, c])


def test_blocks_hashed_ahead_are_found_only_once_computed():
    """hash_ahead (the engine calls it while the device runs the step) registers nothing; the
    blocks become findable as their KV is computed, with the hashes a manager that never
    hashed ahead gives them, and a freed sequence's pending hashes go with its blocks."""
    bm, plain = BlockManager(num_blocks=10, block_size=4), BlockManager(num_blocks=10,
                                                                        block_size=4)
    a, twin = make_seq(range(11)), make_seq(range(11))
    bm.allocate(a)
    plain.allocate(twin)
    bm.hash_ahead(a, 6)  # the first chunk's full block
    bm.hash_ahead(a, 11)  # and the rest, before either chunk is computed
    assert not bm.hash_to_block_id and all(b.hash is None for b in bm.blocks)
    b = make_seq(range(11))
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    for computed in (6, 11):
        a.num_computed_tokens = twin.num_computed_tokens = computed
        bm.cache_computed_blocks(a)
        plain.cache_computed_blocks(twin)
        assert a.block_hashes == twin.block_hashes and len(a.block_hashes) == computed // 4
    assert a.block_hashes[1] == BlockHasher().next_block(range(8))
    c = make_seq([*range(8), 50, 51, 52, 53, 60])
    bm.allocate(c)
    assert c.num_cached_tokens == 8
    bm.hash_ahead(c, 13)  # its third block, past the two hits
    bm.free(c)  # preempted mid-step: the pending hash goes with the blocks
    bm.allocate(c)
    bm.hash_ahead(c, 13)
    c.num_computed_tokens = 13
    bm.cache_computed_blocks(c)
    hasher = BlockHasher()
    assert c.block_hashes == [hasher.next_block(c.token_ids[i:i + 4]) for i in (0, 4, 8)]
    bm.free(b)
    bm.check_invariants([a, c])


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_seq(range(8))  # exactly two full blocks
    bm.allocate(a)
    compute_all(bm, a)
    assert len(a.block_hashes) == 2

    b = make_seq(range(8))
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.num_uncomputed_tokens == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]

    c = make_seq(range(9))  # one more token: both full blocks may hit
    bm.allocate(c)
    assert c.num_cached_tokens == 8 and c.block_table[:2] == a.block_table
    bm.check_invariants([a, b, c])


def test_hit_on_freed_block_that_keeps_its_hash():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_seq(range(10))
    bm.allocate(a)
    compute_all(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 6
    assert bm.blocks[a_blocks[0]].hash is not None  # freed, but still findable

    b = make_seq([*range(8), 50, 51, 52, 53, 54])  # 4 blocks, 2 of them hits with ref_count 0
    bm.allocate(b)
    assert b.block_table[:2] == a_blocks[:2] and b.num_cached_tokens == 8
    assert bm.num_free_blocks == 2  # the hits left the free pool too
    bm.check_invariants([b])


def test_hash_collision_is_not_a_hit(monkeypatch):
    # Every block hashes alike, so only the token check can tell blocks apart.
    monkeypatch.setattr(BlockHasher, "next_block", lambda self, tokens: 42)
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_seq(range(10))
    bm.allocate(a)
    compute_all(bm, a)
    assert bm.hash_to_block_id == {42: a.block_table[0]}

    b = make_seq([9, 9, 9, 9, 9, 9])
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and b.block_table[0] != a.block_table[0]
    bm.check_invariants([a, b])


def test_duplicate_block_computed_twice_keeps_first_map_entry():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = make_seq(range(9)), make_seq(range(9))
    bm.allocate(a)
    bm.allocate(b)  # both prefill the same prompt in one step
    compute_all(bm, a)
    compute_all(bm, b)
    assert a.block_hashes == b.block_hashes
    for block_hash, block_id in zip(a.block_hashes, a.block_table):
        assert bm.hash_to_block_id[block_hash] == block_id
    assert bm.blocks[b.block_table[0]].hash == a.block_hashes[0]
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    bm.check_invariants([])


def test_least_recently_freed_block_is_evicted_first_and_leaves_the_map():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])  # blocks [0, 1, 2]; 0 and 1 get hashed
    bm.allocate(a)
    compute_all(bm, a)
    first, second, tail = a.block_table
    bm.free(a)  # pool order now: 3, tail, second, first
    assert list(bm.free_block_ids) == [3, tail, second, first]

    filler = make_seq([9, 9, 9])  # takes 3 and a's partial tail block
    bm.allocate(filler)
    assert filler.block_table == [3, tail]
    other = make_seq([8])  # takes a's second block, evicting its hash
    bm.allocate(other)
    assert other.block_table == [second]
    assert bm.blocks[second].hash is None and len(bm.hash_to_block_id) == 1

    again = make_seq([1, 2, 3, 4, 5])
    assert bm.can_allocate(again) is False  # 3 blocks, one a ref-0 hit: needs 3, 1 free
    bm.free(filler)
    bm.allocate(again)
    assert again.num_cached_tokens == 2 and again.block_table[0] == first
    bm.check_invariants([other, again])


def test_can_allocate_is_exact_with_ref0_and_live_hits():
    bm = BlockManager(num_blocks=5, block_size=4)
    a = make_seq(range(9))  # 3 blocks, 2 hashed
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)  # pool: 3, 4, then a's blocks
    holder = make_seq([70])
    bm.allocate(holder)  # takes block 3
    filler = make_seq([71])
    bm.allocate(filler)  # takes block 4; 3 free blocks left, two of them a's hashed ones
    b = make_seq([*range(8), 60, 61, 62, 63, 64])  # 4 blocks: 2 ref-0 hits + 2 fresh
    # fresh blocks alone (2) would fit in 3 free; the ref-0 hits need the pool too.
    assert bm.can_allocate(b) is False
    assert allocate_succeeds(bm, b) is False

    bm.free(filler)  # 4 free now
    assert bm.can_allocate(b) is True
    assert allocate_succeeds(bm, b) is True
    assert bm.num_free_blocks == 0

    # b holds the prefix now: a hit on a live block costs no free block.
    c = make_seq([*range(8), 1])  # 3 blocks: 2 live hits + 1 fresh, with 0 free
    assert bm.can_allocate(c) is False and allocate_succeeds(bm, c) is False
    bm.free(b)
    bm.allocate(b2 := make_seq([*range(8), 5]))
    assert b2.num_cached_tokens == 8
    assert bm.num_free_blocks == 1
    assert bm.can_allocate(c) is True and allocate_succeeds(bm, c) is True
    assert bm.num_free_blocks == 0
    bm.check_invariants([holder, b2, c])


def test_append_slots_crosses_block_boundary():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(range(4))  # one full block
    bm.allocate(seq)
    compute_all(bm, seq)
    for step in range(5):
        seq.append_token(100 + step)  # decode: num_computed == num_tokens - 1
        free_before = bm.num_free_blocks
        assert bm.can_append_slots(seq, 1)
        bm.append_slots(seq, 1)
        crossed = seq.num_tokens in (5, 9)
        assert bm.num_free_blocks == free_before - crossed
        assert len(seq.block_table) * 4 >= seq.num_tokens
        compute_all(bm, seq)
        bm.check_invariants([seq])
    assert len(seq.block_table) == 3 and len(seq.block_hashes) == 2
    assert bm.can_append_slots(seq, 4) and not bm.can_append_slots(seq, 9)


# -- counters and the disabled mode ------------------------------------------------------------

def test_counters_are_in_tokens():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_seq(range(10))
    bm.allocate(a)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (8, 0)
    compute_all(bm, a)
    bm.allocate(make_seq(range(10)))
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (16, 8)
    bm.allocate(make_seq(range(4)))  # (4 - 1) // 4 == 0 blocks looked up
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (16, 8)
    bm.can_allocate(make_seq(range(10)))  # asking is not a query
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (16, 8)


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    a = make_seq(range(10))
    bm.allocate(a)
    compute_all(bm, a)
    assert a.block_hashes == [] and bm.hash_to_block_id == {}
    bm.free(a)
    b = make_seq(range(10))
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and b.num_computed_tokens == 0
    assert bm.prefix_cache_queries == bm.prefix_cache_hits == 0
    bm.check_invariants([b])
