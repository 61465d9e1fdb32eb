"""Paged KV-cache block accounting with prefix caching. Plain Python: no torch, no I/O."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from tandem.common.block_hash import BlockHasher
from tandem.workers.engine.sequence import Sequence


class Block:
    """One physical KV block. hash/token_ids are set only once the block's KV is computed."""

    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0  # live sequences whose block_table holds this block
        self.hash: int | None = None  # hash of its full, computed contents and all before
        self.token_ids: tuple[int, ...] | None = None  # kept to verify hits (hash collisions)

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref={self.ref_count}, hash={self.hash})"


class BlockManager:
    """Hands out fixed-size KV blocks to sequences, sharing computed prefix blocks between them.

    A sequence's block_table maps its token positions to physical blocks (block_size=4)::

        tokens       t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .  .
        block_table  [    7      ,     2       ,    11     ]
        block_hashes [ h0=H(t0..t3), h1=H(t0..t7) ]          <- full blocks whose KV is computed

    Invariants (check_invariants asserts them):
      * a block is in the free pool  <=>  its ref_count == 0;
      * ref_count == number of live sequences whose block_table holds the block;
      * hash_to_block_id[h] == b  =>  blocks[b].hash == h, and b's KV is computed. Freed blocks
        keep their hash, so they stay hittable until the pool hands them out again.
    """

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Ordered set of block ids with ref_count 0, least recently freed first: fresh blocks are
        # taken from the front, freed blocks go to the back, a prefix hit removes from anywhere.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        # Told of every hash that enters or leaves hash_to_block_id, on the engine thread:
        # stored(hash), evicted(hash), cleared() when all leave at once (workers/kv_events.py
        # publishes them). None: nobody is.
        self.cache_listener = None
        # seq_id -> (its blocks hashed so far, the running hash past them): a sequence that
        # fills another block hashes only that block, not its whole prefix again. Dropped when
        # the sequence's blocks are freed.
        self._running_hashes: dict[int, tuple[int, BlockHasher]] = {}
        # seq_id -> (hash, token ids) of its full blocks right past block_hashes, hashed by
        # hash_ahead before their KV is computed; cache_computed_blocks registers them once it
        # is. Dropped when the sequence's blocks are freed.
        self._hashed_ahead: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
        # Cumulative, in tokens (as vLLM reports them): tokens looked up and tokens found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by at least one live sequence."""
        return 1.0 - len(self.free_block_ids) / self.num_blocks

    # -- allocation ------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence) -> bool:
        """Exactly whether allocate(seq) would succeed now."""
        hit_block_ids, _ = self._find_cached_prefix(seq)
        return self._num_blocks_to_allocate(seq, hit_block_ids) <= len(self.free_block_ids)

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing computed prefix blocks."""
        if seq.block_table:
            raise RuntimeError(f"allocate: {seq} already holds blocks")
        hit_block_ids, hit_hashes = self._find_cached_prefix(seq)
        num_needed = self._num_blocks_to_allocate(seq, hit_block_ids)
        if num_needed > len(self.free_block_ids):
            raise RuntimeError(f"allocate: {seq} needs {num_needed} free blocks, "
                               f"only {len(self.free_block_ids)} are free")
        if self.enable_prefix_caching:
            num_lookup_blocks = (seq.num_tokens - 1) // self.block_size
            self.prefix_cache_queries += num_lookup_blocks * self.block_size
            self.prefix_cache_hits += len(hit_block_ids) * self.block_size
        # Take the hits first: they must leave the free pool before any fresh block is popped.
        for block_id in hit_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        num_fresh = seq.num_blocks(self.block_size) - len(hit_block_ids)
        seq.block_table = hit_block_ids + [self._take_free_block() for _ in range(num_fresh)]
        seq.block_hashes = hit_hashes
        seq.num_cached_tokens = seq.num_computed_tokens = len(hit_block_ids) * self.block_size

    def can_append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the table can grow to hold num_computed_tokens + num_new_tokens slots."""
        return self._num_missing_blocks(seq, num_new_tokens) <= len(self.free_block_ids)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the block table to hold num_computed_tokens + num_new_tokens slots."""
        num_missing = self._num_missing_blocks(seq, num_new_tokens)
        if num_missing > len(self.free_block_ids):
            raise RuntimeError(f"append_slots: {seq} needs {num_missing} free blocks, "
                               f"only {len(self.free_block_ids)} are free")
        seq.block_table.extend(self._take_free_block() for _ in range(num_missing))

    def hash_ahead(self, seq: Sequence, num_tokens: int) -> None:
        """Hash the full blocks within the sequence's first num_tokens tokens that are neither
        registered nor hashed yet, so that cache_computed_blocks, once their KV is computed,
        only registers them. The engine calls it while the device runs the step that computes
        them, so the hashing (host work that grows with the prompt) overlaps the step: a
        block's hash covers token ids the host knows before the step. Only tokens whose ids
        are known count."""
        if not self.enable_prefix_caching:
            return
        ahead = self._hashed_ahead.setdefault(seq.seq_id, [])
        start = len(seq.block_hashes) + len(ahead)
        end = min(num_tokens, seq.num_known_tokens) // self.block_size
        if end <= start:
            return
        kept_blocks, hasher = self._running_hashes.get(seq.seq_id, (-1, None))
        if kept_blocks != start:
            hasher = BlockHasher(seq.token_ids[:start * self.block_size])
        self._running_hashes[seq.seq_id] = end, hasher
        for index in range(start, end):
            token_ids = tuple(seq.block_token_ids(index, self.block_size))
            ahead.append((hasher.next_block(token_ids), token_ids))

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Make the sequence's newly computed full blocks findable by later prefix lookups
        (with the hashes hash_ahead computed for them, where it did)."""
        if not self.enable_prefix_caching:
            return
        num_computed_full = seq.num_computed_tokens // self.block_size
        num_hashed = len(seq.block_hashes)
        if num_hashed >= num_computed_full:
            return
        self.hash_ahead(seq, seq.num_computed_tokens)  # whatever it has not hashed yet
        ahead = self._hashed_ahead[seq.seq_id]
        computed = ahead[:num_computed_full - num_hashed]
        del ahead[:len(computed)]
        for index, (block_hash, token_ids) in enumerate(computed, num_hashed):
            block = self.blocks[seq.block_table[index]]
            block.hash, block.token_ids = block_hash, token_ids
            seq.block_hashes.append(block_hash)
            # Another sequence may have computed the same block in this step: keep its entry.
            if block_hash not in self.hash_to_block_id:
                self.hash_to_block_id[block_hash] = block.block_id
                if self.cache_listener is not None:
                    self.cache_listener.stored(block_hash)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks. The one free path: finish, preempt and abort call it."""
        if not seq.block_table:
            return
        # Reverse order puts a sequence's tail blocks nearer the front of the pool, so they are
        # reused (evicted) before its prefix blocks, which other requests are likelier to hit.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None  # keeps its hash: still hittable
        seq.block_table = []
        seq.block_hashes = []
        self._running_hashes.pop(seq.seq_id, None)
        self._hashed_ahead.pop(seq.seq_id, None)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0

    def reset_prefix_cache(self) -> int:
        """Forgets every cached block, so no later lookup hits one; returns how many it forgot.
        Blocks that live sequences hold keep their KV and their hash for those sequences only;
        free blocks keep nothing."""
        num_forgotten = len(self.hash_to_block_id)
        for block_id in self.hash_to_block_id.values():
            block = self.blocks[block_id]
            if block.ref_count == 0:
                block.hash, block.token_ids = None, None
        self.hash_to_block_id.clear()
        if self.cache_listener is not None:
            self.cache_listener.cleared()
        return num_forgotten

    # -- helpers ---------------------------------------------------------------------------

    def _find_cached_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Block ids and hashes of the seq's leading blocks found in the cache (no side effects).

        Only the first (num_tokens - 1) // block_size blocks are looked up, so at least one token
        is always left to compute and the model step produces logits for it.
        """
        hit_block_ids: list[int] = []
        hit_hashes: list[int] = []
        if not self.enable_prefix_caching:
            return hit_block_ids, hit_hashes
        hasher = BlockHasher()
        for index in range((seq.num_tokens - 1) // self.block_size):
            token_ids = tuple(seq.block_token_ids(index, self.block_size))
            block_hash = hasher.next_block(token_ids)
            block_id = self.hash_to_block_id.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != token_ids:
                break  # a miss (or a hash collision) ends the shared prefix
            hit_block_ids.append(block_id)
            hit_hashes.append(block_hash)
        return hit_block_ids, hit_hashes

    def _num_blocks_to_allocate(self, seq: Sequence, hit_block_ids: list[int]) -> int:
        """Free-pool blocks allocate() takes: the fresh ones plus hits now sitting in the pool."""
        num_fresh = seq.num_blocks(self.block_size) - len(hit_block_ids)
        num_hits_in_pool = sum(1 for b in hit_block_ids if self.blocks[b].ref_count == 0)
        return num_fresh + num_hits_in_pool

    def _num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        num_slots = seq.num_computed_tokens + num_new_tokens
        num_blocks_needed = (num_slots + self.block_size - 1) // self.block_size
        return max(0, num_blocks_needed - len(seq.block_table))

    def _take_free_block(self) -> int:
        """Pop the least recently freed block, evicting whatever cached prefix it still held."""
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            # The map may point at a duplicate holding the same contents; leave that entry alone.
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
                if self.cache_listener is not None:
                    self.cache_listener.evicted(block.hash)
            block.hash = block.token_ids = None
        block.ref_count = 1
        return block_id

    # -- checking --------------------------------------------------------------------------

    def check_invariants(self, live_seqs: Iterable[Sequence]) -> None:
        """Assert the accounting invariants given every sequence that currently holds blocks."""
        ref_counts = [0] * self.num_blocks
        for seq in live_seqs:
            table = seq.block_table
            assert len(set(table)) == len(table), f"{seq} holds a block twice"
            assert len(table) * self.block_size >= seq.num_computed_tokens, \
                f"{seq}: block table shorter than its computed tokens"
            assert len(seq.block_hashes) <= seq.num_computed_tokens // self.block_size, \
                f"{seq}: hashes for blocks whose KV is not computed"
            for index, block_id in enumerate(table):
                ref_counts[block_id] += 1
                block = self.blocks[block_id]
                if index < len(seq.block_hashes):
                    assert block.hash == seq.block_hashes[index], \
                        f"{seq}: block {block_id} lost hash {seq.block_hashes[index]}"
                else:  # not computed (or not yet cached) by this seq: must not be findable
                    assert block.hash is None, f"{seq}: uncomputed block {block_id} has a hash"
        for block in self.blocks:
            is_free = block.block_id in self.free_block_ids
            assert is_free == (block.ref_count == 0), \
                f"{block}: in free pool={is_free} disagrees with its ref_count"
            assert block.ref_count == ref_counts[block.block_id], \
                f"{block}: ref_count != {ref_counts[block.block_id]} live holders"
            assert (block.hash is None) == (block.token_ids is None), f"{block}: half-set hash"
        for block_hash, block_id in self.hash_to_block_id.items():
            assert self.blocks[block_id].hash == block_hash, \
                f"hash {block_hash} maps to {self.blocks[block_id]}, whose hash differs"
