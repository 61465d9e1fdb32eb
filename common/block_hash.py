"""The KV block hash, shared by workers (prefix cache keys) and the router (which computes the
same keys from a prompt's token ids to know which worker holds its prefix).

A full block's hash is the hash of every token up to the block's end: SHA-256 over the token
ids, each as 8 little-endian bytes, truncated to its first 8 bytes (read little-endian). It
depends on the block's tokens and on every token before them, as a chain of per-block hashes
would, and it does not depend on the block size. Unlike a chain, the hash of any one block of a
prompt is a single call over the prompt's leading bytes: the router probes the few block counts
it needs (PromptBlockHashes) instead of hashing every block in turn. Workers compute the same
values block by block with one running SHA-256 per sequence (BlockHasher).

Collisions: 64 bits leave a chance of about n / 2**64 that a prompt block wrongly matches one
of n cached blocks (below 1e-13 for a million). A wrong match in the router's index only sends
a request to a worker that then misses; a worker serving a hit first checks that the cached
block holds the same token ids (so a collision must also repeat the block's own tokens to
serve wrong KV), and SHA-256 lets nobody construct a colliding prompt without knowing the
tokens it would collide with. Stable across processes and machines, unlike
Python's salted hash().
"""
from __future__ import annotations

import bisect
import hashlib
import struct
from collections.abc import Sequence


# A probe keeps its running hash at least this often (in packed token bytes): copying a state
# costs about as much as hashing a few hundred bytes.
_CHECKPOINT_BYTES = 2048


def _pack(token_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}q", *token_ids)


def _key(sha) -> int:
    return int.from_bytes(sha.digest()[:8], "little")


class BlockHasher:
    """The hashes of a sequence's full blocks in order, each from the running hash of the
    tokens so far (a worker's cache lookup and the blocks it caches after a step)."""

    def __init__(self, token_ids_before: Sequence[int] = ()) -> None:
        """`token_ids_before`: the tokens of the blocks before the first one to hash."""
        self._sha = hashlib.sha256(_pack(token_ids_before))

    def next_block(self, token_ids: Sequence[int]) -> int:
        """The hash of the block after those hashed so far, which holds `token_ids`."""
        self._sha.update(_pack(token_ids))
        return _key(self._sha)


class PromptBlockHashes:
    """The hashes of a prompt's leading full blocks (at most `max_blocks`), each computed when
    asked for: hash_of(count) is the hash of the count-th block.

    The tokens are packed once, as far as asked. Every probe keeps its running SHA-256 state,
    and one every _CHECKPOINT_BYTES of tokens on its way; a later probe starts from the nearest
    state before it, so once a probe has hashed the prompt, any other probe hashes at most
    _CHECKPOINT_BYTES more.
    The prompt's later picks (the decode tier after the prefill tier) reuse what is kept.
    """

    def __init__(self, token_ids: Sequence[int], block_size: int,
                 max_blocks: int | None = None) -> None:
        num_blocks = len(token_ids) // block_size
        if max_blocks is not None:
            num_blocks = min(num_blocks, max_blocks)
        self.num_blocks = max(0, num_blocks)
        self.block_size = block_size
        self.token_ids = token_ids
        self.probed: dict[int, int] = {}  # block count -> hash of that block
        self._packed = b""  # the leading tokens' bytes, as far as a probe needed them
        # Block counts with a kept SHA-256 state (ascending), and the states.
        self._state_counts: list[int] = [0]
        self._states: list = [hashlib.sha256()]

    def __len__(self) -> int:
        return self.num_blocks

    def hash_of(self, count: int) -> int:
        """The hash of block number `count` (1-based): of the prompt's first count blocks."""
        if not 1 <= count <= self.num_blocks:
            raise IndexError(f"block {count} of a prompt with {self.num_blocks} full blocks")
        block_hash = self.probed.get(count)
        if block_hash is None:
            step = 8 * self.block_size
            if len(self._packed) < count * step:
                start = len(self._packed) // 8
                self._packed += _pack(self.token_ids[start:count * self.block_size])
            counts, states = self._state_counts, self._states
            position = bisect.bisect_right(counts, count) - 1
            base = counts[position]
            sha = states[position].copy()
            packed = memoryview(self._packed)
            stride = max(1, _CHECKPOINT_BYTES // step)
            while count - base > stride:  # no state lies between base and count
                sha.update(packed[base * step:(base + stride) * step])
                base += stride
                position += 1
                counts.insert(position, base)
                states.insert(position, sha.copy())
            sha.update(packed[base * step:count * step])
            counts.insert(position + 1, count)
            states.insert(position + 1, sha)
            block_hash = self.probed[count] = _key(sha)
        return block_hash


def prefix_block_hashes(token_ids: Sequence[int], block_size: int,
                        max_blocks: int | None = None) -> list[int]:
    """The hashes of the leading full blocks of `token_ids` (at most `max_blocks`), in order."""
    num_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    hasher = BlockHasher()
    return [hasher.next_block(token_ids[index * block_size:(index + 1) * block_size])
            for index in range(max(0, num_blocks))]
