"""RecentPrompts: a prompt that repeats the start of a recent one reuses the hashes of the
blocks they share, and its hashes are exactly the chained hashes of its own tokens."""
from __future__ import annotations

import random

import pytest

from tandem.common.block_hash import prefix_block_hashes
from tandem.router.recent_prompts import RecentPrompts

BLOCK = 4


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(n)]


def test_a_conversations_next_turn_hashes_only_its_new_blocks():
    rng = random.Random(1)
    recent = RecentPrompts()
    turn = tokens(rng, 41)
    first = recent.hashes(turn, BLOCK)
    assert list(first) == prefix_block_hashes(turn, BLOCK)
    history = turn + tokens(rng, 30)
    second = recent.hashes(history, BLOCK)
    assert second.hashes == first.hashes  # known before anything is read: 10 blocks
    assert list(second) == prefix_block_hashes(history, BLOCK)


def test_a_shared_system_prompt_reuses_only_the_blocks_both_prompts_hold():
    rng = random.Random(2)
    recent = RecentPrompts()
    system = tokens(rng, 18)  # 4 full blocks, then 2 tokens into the fifth
    a = system + tokens(rng, 20)
    list(recent.hashes(a, BLOCK))
    b = system + tokens(rng, 20)
    hashes = recent.hashes(b, BLOCK)
    assert hashes.hashes == prefix_block_hashes(system, BLOCK)  # the fifth block differs
    assert list(hashes) == prefix_block_hashes(b, BLOCK)


def test_only_hashed_blocks_are_reused_and_only_as_many_as_asked():
    rng = random.Random(3)
    recent = RecentPrompts()
    prompt = tokens(rng, 200)
    partial = recent.hashes(prompt, BLOCK, max_blocks=30)
    next(iter(partial))  # hashes one run of blocks, not all 30
    longer = recent.hashes(prompt + [7], BLOCK)
    assert longer.hashes == partial.hashes and len(longer.hashes) < 30
    assert list(longer) == prefix_block_hashes(prompt + [7], BLOCK)
    shorter = recent.hashes(prompt[:9], BLOCK)
    assert shorter.hashes == prefix_block_hashes(prompt[:9], BLOCK)


def test_other_first_blocks_and_block_sizes_share_nothing_and_the_oldest_goes():
    rng = random.Random(4)
    recent = RecentPrompts(capacity=2)
    a, b = tokens(rng, 20), tokens(rng, 20)
    list(recent.hashes(a, BLOCK))
    list(recent.hashes(b, BLOCK))
    assert recent.hashes(tuple(b) + (5,), BLOCK).hashes == prefix_block_hashes(b, BLOCK)
    assert recent.hashes(a, 2).hashes == []  # another block size: a third entry, a at 4 goes
    assert recent.hashes(a + [1], BLOCK).hashes == []


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        RecentPrompts(capacity=0)
