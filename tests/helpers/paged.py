"""A mixed batch's place in a paged cache, for op tests that fill the cache by hand."""
from __future__ import annotations

import torch

from tandem.workers.ops.attention import AttentionMetadata


def scattered_batch(layout: list[tuple[int, int]], num_blocks: int, block_size: int,
                    gen: torch.Generator) -> tuple[list[list[int]], AttentionMetadata]:
    """Sequences given as (tokens already cached, new tokens) get blocks drawn from a random
    permutation of the cache (scattered, none shared). Returns each sequence's block table and
    this step's metadata: the new tokens' slots, query offsets, lengths, padded tables.
    Uses gen once (the permutation), before any tensor the caller draws."""
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, starts, lens = [], [], [0], []
    for cached, new in layout:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // block_size))]
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(cached, total)]
        tables.append(table)
        starts.append(starts[-1] + new)
        lens.append(total)
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        max_query_len=max(n for _, n in layout), max_seq_len=max(lens),
        query_start_loc_host=starts, seq_lens_host=lens)
    return tables, meta
