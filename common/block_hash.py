"""The chained KV block hash, shared by workers (prefix cache keys) and the router (which
computes the same keys from a prompt's token ids to know which worker holds its prefix)."""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


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


def prefix_block_hashes(token_ids: Sequence[int], block_size: int,
                        max_blocks: int | None = None) -> list[int]:
    """The chained hashes of the leading full blocks of `token_ids` (at most `max_blocks`):
    compute_block_hash block after block, with the tokens packed once (the router's per-request
    cost)."""
    num_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    if num_blocks <= 0:
        return []
    packed = struct.pack(f"<{num_blocks * block_size}q", *token_ids[:num_blocks * block_size])
    step = 8 * block_size
    blake2b = hashlib.blake2b
    prev_hash = int.from_bytes(blake2b(b"\x00" + packed[:step], digest_size=8).digest(),
                               "little")
    hashes = [prev_hash]
    for start in range(step, num_blocks * step, step):
        digest = blake2b(b"\x01" + prev_hash.to_bytes(8, "little") + packed[start:start + step],
                         digest_size=8).digest()
        prev_hash = int.from_bytes(digest, "little")
        hashes.append(prev_hash)
    return hashes
