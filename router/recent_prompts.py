"""The block hashes of the router's recent prompts, so that a prompt repeating the start of one
of them hashes only the blocks after it.

A conversation's next turn re-sends its whole history, and many requests share a system
prompt: without this, every such prompt is hashed from its first block again. Prompts are
found by their first block's tokens (one entry per distinct first block, the latest prompt
that had it); the shared blocks are checked token for token, so a reused hash is always the
hash of the same tokens.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tandem.common.block_hash import PromptBlockHashes

DEFAULT_CAPACITY = 1024  # prompts kept (each holds a reference to its token list)


class RecentPrompts:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        # (block size, first block's tokens) -> the latest prompt's hashes
        self._by_first_block: OrderedDict[tuple, PromptBlockHashes] = OrderedDict()

    def hashes(self, token_ids: Sequence[int], block_size: int,
               max_blocks: int | None = None) -> PromptBlockHashes:
        """The prompt's lazy block hashes, seeded with those of the leading blocks it shares
        with the latest recent prompt that began with the same block; remembered in its place."""
        if not isinstance(token_ids, list):
            token_ids = list(token_ids)
        key = (block_size, tuple(token_ids[:block_size]))
        earlier = self._by_first_block.pop(key, None)
        known = earlier.hashes[:_num_shared_blocks(earlier, token_ids)] if earlier else ()
        hashes = PromptBlockHashes(token_ids, block_size, max_blocks, known=known)
        if len(token_ids) >= block_size:
            self._by_first_block[key] = hashes
            if len(self._by_first_block) > self.capacity:
                self._by_first_block.popitem(last=False)
        return hashes


def _num_shared_blocks(earlier: PromptBlockHashes, token_ids: list[int]) -> int:
    """How many of `earlier`'s hashed leading blocks `token_ids` repeats token for token."""
    block_size = earlier.block_size
    num_hashed = min(len(earlier.hashes), len(token_ids) // block_size)
    earlier_tokens = earlier.token_ids
    # Spans of blocks compared whole: doubling while they match, halving after a mismatch
    # (blocks before `num_shared` match; the first differing block lies in a failed span).
    num_shared, span = 0, num_hashed  # the usual case first: a conversation goes on
    while num_shared < num_hashed:
        end = min(num_hashed, num_shared + span)
        if token_ids[num_shared * block_size:end * block_size] == \
                earlier_tokens[num_shared * block_size:end * block_size]:
            num_shared, span = end, span * 2
        elif end - num_shared == 1:
            break
        else:
            span = (end - num_shared) // 2
    return num_shared
