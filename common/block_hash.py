"""The KV block hash, shared by workers (prefix cache keys) and the router (which computes the
same keys from a prompt's token ids to know which worker holds its prefix).

A full block's hash is the hash of every token up to the block's end: SHA-256 over the token
ids, each as 4 little-endian bytes (ids are int32 in the protocol; one below zero hashes as its
two's complement), truncated to its first 8 bytes (read little-endian). It
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

import array
import hashlib
import sys
from collections.abc import Sequence


# Kept running hashes lie under this many packed token bytes apart: keeping one more state costs
# about as much as hashing 500 bytes and a later probe hashes half the distance on average, so
# for the 6-12 probes after a 2048-token prompt's first long one, the states kept and the bytes
# hashed balance near here. Every update stays below 2048 bytes (for blocks under 512 tokens),
# from which hashlib releases the GIL around an update (and then around every later update of
# that object), letting another thread in mid-pick.
_CHECKPOINT_BYTES = 1024
_ID_BYTES = 4  # per token id, packed
if array.array("I").itemsize != _ID_BYTES:
    raise ImportError("tandem's block hash needs a 4-byte C unsigned int (array typecode 'I')")


def _pack(token_ids: Sequence[int]) -> array.array:
    """The token ids as 4 little-endian bytes each (the id modulo 2**32: the protocol's int32
    ids, two's complement below zero), in an array of unsigned 32-bit items.

    array("I", ids) converts a list of ids several times faster than struct.pack."""
    try:
        packed = array.array("I", token_ids)
    except OverflowError:  # an id below zero or past 32 bits (never a real token)
        packed = array.array("I", [token_id & 0xFFFFFFFF for token_id in token_ids])
    if sys.byteorder == "big":
        packed.byteswap()
    return packed


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

    The blocks' ids are packed once (a first-block probe packs that block's alone). The running
    SHA-256 states at every multiple of `stride` blocks (under _CHECKPOINT_BYTES of packed ids)
    are kept as far as any probe reached, so a probe copies the kept state at or before its
    block and hashes fewer than `stride` blocks more. The prompt's later picks (the decode tier
    after the prefill tier) reuse the probed hashes and the states.
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
        self.stride = max(1, (_CHECKPOINT_BYTES - 1) // (_ID_BYTES * block_size))  # blocks
        self._packed: memoryview | None = None  # the blocks' tokens, packed (token units)
        self._states = [hashlib.sha256()]  # [i]: the running hash of the first i * stride blocks

    def __len__(self) -> int:
        return self.num_blocks

    def hash_of(self, count: int) -> int:
        """The hash of block number `count` (1-based): of the prompt's first count blocks."""
        block_hash = self.probed.get(count)
        if block_hash is not None:
            return block_hash
        if not 1 <= count <= self.num_blocks:
            raise IndexError(f"block {count} of a prompt with {self.num_blocks} full blocks")
        block_size = self.block_size
        end = count * block_size
        packed = self._packed
        if packed is None or len(packed) < end:
            packed = self._packed = memoryview(_pack(self._leading_tokens(end)))
        kept = count // self.stride  # the last kept state at or before the block
        states = self._states
        if len(states) <= kept:
            self._keep_states(kept)
        sha = states[kept]
        start = kept * self.stride * block_size
        if start < end:
            sha = sha.copy()
            sha.update(packed[start:end])
        block_hash = self.probed[count] = int.from_bytes(sha.digest()[:8], "little")
        return block_hash

    def _keep_states(self, last: int) -> None:
        """Keeps the running hashes up to the `last`-th multiple of the stride."""
        states, packed = self._states, self._packed
        stride_tokens = self.stride * self.block_size
        while len(states) <= last:
            end = len(states) * stride_tokens
            sha = states[-1].copy()
            sha.update(packed[end - stride_tokens:end])
            states.append(sha)

    def _leading_tokens(self, num_tokens: int) -> Sequence[int]:
        """At least the first `num_tokens` tokens, to pack: just those while they are at most
        half of the blocks' tokens (a first-block probe of a prompt nobody holds packs little),
        else all the blocks' tokens, or the whole prompt where only a block's worth lies past
        them (slicing costs more than packing a few extra tokens)."""
        blocks_tokens = self.num_blocks * self.block_size
        if 2 * num_tokens <= blocks_tokens:
            return self.token_ids[:num_tokens]
        if len(self.token_ids) - blocks_tokens <= self.block_size:
            return self.token_ids
        return self.token_ids[:blocks_tokens]


def prefix_block_hashes(token_ids: Sequence[int], block_size: int,
                        max_blocks: int | None = None) -> list[int]:
    """The hashes of the leading full blocks of `token_ids` (at most `max_blocks`), in order."""
    num_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    hasher = BlockHasher()
    return [hasher.next_block(token_ids[index * block_size:(index + 1) * block_size])
            for index in range(max(0, num_blocks))]
