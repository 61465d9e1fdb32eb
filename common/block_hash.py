"""The chained KV block hash, shared by workers (prefix cache keys) and the router (which
computes the same keys from a prompt's token ids to know which worker holds its prefix)."""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence

# Blocks PromptBlockHashes hashes per run: enough that packing the tokens costs little per
# block, few enough that a walk ending early leaves little hashed for nothing.
_BLOCKS_PER_RUN = 16


def compute_block_hash(prev_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained hash of one full block: depends on the block's tokens and on every block before it.

    Stable across processes and machines (blake2b over a fixed little-endian encoding), unlike
    Python's salted hash(). prev_hash is None for a sequence's first block.
    """
    h = hashlib.blake2b(digest_size=8)
    # A one-byte tag keeps "no parent" distinct from a parent whose hash happens to be 0.
    h.update(b"\x00" if prev_hash is None else b"\x01" + prev_hash.to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little")


class PromptBlockHashes:
    """The chained hashes (compute_block_hash) of the leading full blocks of a prompt, at most
    `max_blocks`, computed only as far as they are read and kept for the next reader.

    The router reads them while matching a prompt against its index and stops at the first
    block no worker holds, so a prompt costs the hashing of its cached prefix plus at most a
    run of blocks, not of its whole length; a request's later picks (the decode tier after the
    prefill tier) read on from what is kept. Blocks are hashed in runs of _BLOCKS_PER_RUN: each
    run packs its tokens once and chains on the previous block's digest bytes (the digest is
    the hash's little-endian encoding, so no integer conversion sits inside the chain).
    """

    def __init__(self, token_ids: Sequence[int], block_size: int,
                 max_blocks: int | None = None, known: Sequence[int] = ()) -> None:
        """`known`: the hashes of the prompt's leading blocks where they are known already (an
        earlier prompt had the same tokens there); only the blocks after them are hashed."""
        num_blocks = len(token_ids) // block_size
        if max_blocks is not None:
            num_blocks = min(num_blocks, max_blocks)
        self.num_blocks = max(0, num_blocks)
        self.block_size = block_size
        self.token_ids = token_ids
        self.hashes: list[int] = list(known[:self.num_blocks])  # the blocks hashed so far
        # The latest hashed block's digest: the hash's little-endian bytes.
        self._last_digest = self.hashes[-1].to_bytes(8, "little") if self.hashes else b""

    def __len__(self) -> int:
        return self.num_blocks

    def __iter__(self) -> Iterator[int]:
        position = 0
        while position < self.num_blocks:
            if position == len(self.hashes):
                self._hash_next_run()
            run = self.hashes[position:]
            position += len(run)
            yield from run

    def _hash_next_run(self) -> None:
        first = len(self.hashes)
        stop = min(self.num_blocks, first + _BLOCKS_PER_RUN)
        block_size = self.block_size
        packed = struct.pack(f"<{(stop - first) * block_size}q",
                             *self.token_ids[first * block_size:stop * block_size])
        step = 8 * block_size
        blake2b = hashlib.blake2b
        digest = self._last_digest
        if first == 0:
            digest = blake2b(b"\x00" + packed[:step], digest_size=8).digest()
        digests = [digest] if first == 0 else []
        for start in range(step if first == 0 else 0, len(packed), step):
            digest = blake2b(b"\x01" + digest + packed[start:start + step],
                             digest_size=8).digest()
            digests.append(digest)
        self._last_digest = digest
        self.hashes.extend(struct.unpack(f"<{len(digests)}Q", b"".join(digests)))


def prefix_block_hashes(token_ids: Sequence[int], block_size: int,
                        max_blocks: int | None = None) -> list[int]:
    """The chained hashes of the leading full blocks of `token_ids` (at most `max_blocks`)."""
    return list(PromptBlockHashes(token_ids, block_size, max_blocks))
