"""The lightning indexer of DeepSeek sparse attention (DSA, DeepSeek-V3.2): which cached tokens
each query may attend to. The MLA op (sparse_mla.py) applies the selection.

Names, per layer and token (Hi = index_n_heads, Di = index_head_dim):

    q_t [Hi, Di]  index queries, roped (the model projects them; models/deepseek_v32.py)
    k_t [Di]      the token's index key, roped; cached, one row per token (below)
    w_t [Hi]      per-head weights, already multiplied by Hi^-0.5, fp32

    score(i, j) = sum_h w_i[h] * relu(Di^-0.5 * q_i[h] . k_j)          computed in fp32

The query at absolute position p sees key j iff j <= p and j is among the index_topk keys of
highest score(i, 0..p). While p + 1 <= index_topk that is every earlier key: the attention is
plain causal attention until a context outgrows index_topk. Equal scores are broken by
torch.topk, as transformers breaks them (only exact ties at the cut can differ).

Cache layout, per layer, beside the MLA latent and with the same blocks and slots::

    index_key_cache: [num_blocks, block_size, 1, Di]    row = k_t of one token

A decode step (or a later prefill chunk, or a prefill after a prefix-cache hit) scores every
earlier token from this cache, so the cache must travel with the latents in a KV handoff
(common/kv_layout.py kind "mla_indexer").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.workers.ops.kv_cache import write_slots

# Bounds the [chunk, Hi, S] fp32 score tensor of a long prefill (about 256 MB).
MAX_SCORE_ELEMENTS = 1 << 26


@dataclass(slots=True)
class IndexerInputs:
    """This step's indexer tensors for the flat batch of T tokens."""

    q: torch.Tensor  # [T, Hi, Di], roped
    k: torch.Tensor  # [T, Di], roped; written to the index key cache
    weights: torch.Tensor  # [T, Hi] fp32, times Hi^-0.5


def write_index_keys(index_k: torch.Tensor, index_key_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    """Row slot_mapping[t] of the cache becomes index_k[t]."""
    write_slots(index_key_cache, slot_mapping, index_k[:, None])


def topk_visibility(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                    index_topk: int) -> torch.Tensor | None:
    """Which keys each query of one sequence sees: q [L, Hi, Di], weights [L, Hi], keys [S, Di]
    (positions 0..S-1; the L queries are the last L positions) -> [L, S] bool, True where the
    query attends (causal and selected); None when S <= index_topk (every query then sees
    every earlier key: plain causal attention)."""
    query_len, num_heads, head_dim = q.shape
    seq_len = keys.shape[0]
    if seq_len <= index_topk:
        return None
    key_pos = torch.arange(seq_len, device=q.device)
    causal = key_pos[None, :] <= key_pos[seq_len - query_len:, None]  # [L, S]
    keys_t = keys.float().t()  # [Di, S]
    selected = torch.zeros(query_len, seq_len, dtype=torch.bool, device=q.device)
    chunk = max(1, MAX_SCORE_ELEMENTS // (num_heads * seq_len))
    for start in range(0, query_len, chunk):
        end = min(start + chunk, query_len)
        # Same op order as transformers: per-head scores, relu, then the weighted head sum.
        scores = F.relu(torch.matmul(q[start:end].float(), keys_t) * head_dim ** -0.5)
        index = torch.matmul(weights[start:end, None, :].float(), scores)[:, 0]  # [l, S]
        index = index.masked_fill(~causal[start:end], float("-inf"))
        # Future keys score -inf, so a query with fewer than index_topk earlier keys picks all
        # of them (plus future ones, which `causal` removes below).
        top = index.topk(index_topk, dim=-1).indices
        selected[start:end].scatter_(-1, top, True)
    return selected & causal
