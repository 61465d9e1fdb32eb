"""Mixture-of-experts for decode-sized batches: routing and the experts in four launches.

At decode a MoE layer's cost is reading the chosen experts' weights (8 of 128 per token for
Qwen3-30B-A3B); the arithmetic is tiny. The general path (moe_aiter.py) spends ~40 small
launches per layer on routing and on sorting the (token, slot) pairs by expert, which under a
CUDA graph still cost a microsecond or more each, and its block-major grid reads an expert's
weights once per block of 16 pairs. Here a layer runs as

    [route + align]   one program: softmax, top-k, renormalise (optional: ROUTE), then the
                      pairs grouped by expert (counts, starts, the list of chosen experts)
    [gate_up]         one program per (chosen expert, BLOCK_N columns): its pairs' rows of x
                      times [gate | up], silu(gate) * up
    [down]            one program per (chosen expert, BLOCK_N columns): act times down, times
                      the pair's routing weight
    [sum over k]      torch: each token's k weighted expert outputs added

Each chosen expert's weights are read once per step however many tokens chose it (the grid's
first axis walks the chosen experts, not the pairs), so the step is bound by the distinct
experts' bytes. Every size the grid depends on is known on the host from the token count, so a
call captures in a CUDA graph.

Numerics: fp32 accumulation; gate and up are rounded to the activation dtype before
silu(gate) * up, as the unfused path stores them; each weighted expert output is rounded to the
activation dtype before the sum over k (as moe_aiter.py does).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Largest token count * top_k the one-program align takes: its loops walk the pairs in CHUNKs,
# and beyond a few hundred pairs the general path's grouped GEMMs are the better tool anyway.
MAX_PAIRS = 1024
_ALIGN_CHUNK = 64


@triton.jit
def _route_align_kernel(logits_ptr, stride_logits, weights_ptr, ids_ptr, sorted_ptr,
                        counts_ptr, starts_ptr, active_ptr, num_active_ptr, T, E,
                        TOP_K: tl.constexpr, ROUTE: tl.constexpr, RENORMALIZE: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                        BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """One program. ROUTE: logits [T, E] -> weights [T, TOP_K] fp32, ids [T, TOP_K] int32
    (softmax over E, top-k, optionally renormalised to sum to 1). Then, from ids:
      counts [E], starts [E]: pairs per expert and where its run starts in sorted;
      sorted [T * TOP_K]: flat pair ids (t * TOP_K + j), expert by expert, in pair order;
      active [<= E]: the chosen experts in id order; num_active [1]: how many."""
    experts = tl.arange(0, BLOCK_E)
    num_pairs = T * TOP_K
    if ROUTE:
        tokens = tl.arange(0, BLOCK_T)
        slots = tl.arange(0, BLOCK_TOPK)
        valid = (tokens < T)[:, None] & (experts < E)[None, :]
        x = tl.load(logits_ptr + tokens[:, None] * stride_logits + experts[None, :],
                    mask=valid, other=float("-inf")).to(tl.float32)
        row_max = tl.where(tokens < T, tl.max(x, 1), 0.0)
        ex = tl.where(valid, tl.exp(x - row_max[:, None]), 0.0)
        denom = tl.sum(ex, 1)
        probs = ex / tl.where(denom > 0, denom, 1.0)[:, None]
        score = tl.where(valid, probs, -1.0)
        top_w = tl.zeros([BLOCK_T, BLOCK_TOPK], tl.float32)
        top_i = tl.zeros([BLOCK_T, BLOCK_TOPK], tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.argmax(score, 1)
            value = tl.max(score, 1)
            top_w = tl.where(slots[None, :] == j, value[:, None], top_w)
            top_i = tl.where(slots[None, :] == j, best[:, None].to(tl.int32), top_i)
            score = tl.where(experts[None, :] == best[:, None], -2.0, score)
        if RENORMALIZE:
            total = tl.sum(top_w, 1)
            top_w = top_w / tl.where(total > 0, total, 1.0)[:, None]
        out_mask = (tokens < T)[:, None] & (slots < TOP_K)[None, :]
        flat = tokens[:, None] * TOP_K + slots[None, :]
        tl.store(weights_ptr + flat, top_w, mask=out_mask)
        tl.store(ids_ptr + flat, top_i, mask=out_mask)
        tl.debug_barrier()  # the align below reads ids back, written by other threads
    counts = tl.zeros([BLOCK_E], tl.int32)
    lanes = tl.arange(0, CHUNK)
    for c0 in range(0, num_pairs, CHUNK):
        ids = tl.load(ids_ptr + c0 + lanes, mask=c0 + lanes < num_pairs, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), 0)
    starts = tl.cumsum(counts, 0) - counts
    tl.store(counts_ptr + experts, counts, mask=experts < E)
    tl.store(starts_ptr + experts, starts, mask=experts < E)
    is_active = counts > 0
    active_rank = tl.cumsum(is_active.to(tl.int32), 0) - 1
    tl.store(active_ptr + active_rank, experts, mask=is_active)
    tl.store(num_active_ptr, tl.sum(is_active.to(tl.int32), 0))
    placed = tl.zeros([BLOCK_E], tl.int32)  # pairs of each expert already placed
    for c0 in range(0, num_pairs, CHUNK):
        pairs = c0 + lanes
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        onehot = ids[:, None] == experts[None, :]  # [CHUNK, BLOCK_E]
        base = tl.sum(tl.where(onehot, (starts + placed)[None, :], 0), 1)
        earlier = (ids[:, None] == ids[None, :]) & (lanes[:, None] > lanes[None, :])
        within = tl.sum(earlier.to(tl.int32), 1)
        tl.store(sorted_ptr + base + within, pairs, mask=pairs < num_pairs)
        placed += tl.sum(onehot.to(tl.int32), 0)


@triton.jit
def _expert_of_program(active_ptr, num_active_ptr, counts_ptr, starts_ptr):
    """(expert, its pair count, its start in sorted) for this program's chosen-expert slot;
    count 0 for a slot past the chosen experts, so the program does nothing."""
    slot = tl.program_id(0)
    is_slot = slot < tl.load(num_active_ptr)
    expert = tl.load(active_ptr + slot, mask=is_slot, other=0)
    count = tl.load(counts_ptr + expert, mask=is_slot, other=0)
    start = tl.load(starts_ptr + expert, mask=is_slot, other=0)
    return expert, count, start


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, act_ptr, sorted_ptr, counts_ptr, starts_ptr, active_ptr,
                    num_active_ptr, K, I, stride_x, stride_we, stride_wn, stride_act,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """act[pair, n] = silu(x[token] . w[e, n]) * (x[token] . w[e, I + n]) for this program's
    expert e, its pairs, and BLOCK_N of the I columns."""
    expert, count, start = _expert_of_program(active_ptr, num_active_ptr, counts_ptr, starts_ptr)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    gate_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
    up_rows = gate_rows + I * stride_wn
    for m0 in range(0, count, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < count
        pairs = tl.load(sorted_ptr + start + offs_m, mask=mask_m, other=0)
        x_rows = x_ptr + (pairs // TOP_K).to(tl.int64)[:, None] * stride_x
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                        other=0.0)
            w_mask = mask_k[:, None] & mask_n[None, :]
            w_gate = tl.load(gate_rows + offs_k[:, None], mask=w_mask, other=0.0)
            w_up = tl.load(up_rows + offs_k[:, None], mask=w_mask, other=0.0)
            acc_gate = tl.dot(x, w_gate, acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(x, w_up, acc_up, input_precision=DOT_PRECISION)
        gate = acc_gate.to(act_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(act_ptr.dtype.element_ty).to(tl.float32)
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(act_ptr + pairs.to(tl.int64)[:, None] * stride_act + offs_n[None, :],
                 act.to(act_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, out_ptr, weights_ptr, sorted_ptr, counts_ptr, starts_ptr,
                 active_ptr, num_active_ptr, K, N, stride_act, stride_we, stride_wn, stride_out,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """out[pair, n] = weight[pair] * (act[pair] . w[e, n]) for this program's expert e, its
    pairs, and BLOCK_N of the N (hidden) columns."""
    expert, count, start = _expert_of_program(active_ptr, num_active_ptr, counts_ptr, starts_ptr)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
    for m0 in range(0, count, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < count
        pairs = tl.load(sorted_ptr + start + offs_m, mask=mask_m, other=0)
        a_rows = act_ptr + pairs.to(tl.int64)[:, None] * stride_act
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            a = tl.load(a_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                        other=0.0)
            w = tl.load(w_rows + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :],
                        other=0.0)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        routing_weight = tl.load(weights_ptr + pairs, mask=mask_m, other=0.0)
        y = acc * routing_weight[:, None]
        tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_out + offs_n[None, :],
                 y.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def default_config(num_pairs: int) -> dict[str, int]:
    """Block sizes and warps for the two expert kernels."""
    return {"block_m": 16, "gate_up_block_n": 32, "down_block_n": 32, "block_k": 128,
            "num_warps": 4, "num_stages": 3}


def fits(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether this path takes the batch: at most MAX_PAIRS (token, slot) pairs."""
    return 0 < num_tokens * top_k <= MAX_PAIRS and num_experts <= 1024


def _route_align(logits: torch.Tensor | None, topk_weights: torch.Tensor | None,
                 topk_ids: torch.Tensor | None, num_tokens: int, top_k: int,
                 num_experts: int, renormalize: bool, device: torch.device):
    route = logits is not None
    num_pairs = num_tokens * top_k
    if route:
        topk_weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
        topk_ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    ints = torch.empty(num_pairs + 3 * num_experts + 1, dtype=torch.int32, device=device)
    sorted_ids = ints[:num_pairs]
    counts, starts, active = ints[num_pairs:].narrow(0, 0, 3 * num_experts).view(3, -1)
    num_active = ints[-1:]
    block_e = triton.next_power_of_2(num_experts)
    _route_align_kernel[(1,)](
        logits if route else topk_ids, logits.stride(0) if route else 0, topk_weights,
        topk_ids, sorted_ids, counts, starts, active, num_active, num_tokens, num_experts,
        TOP_K=top_k, ROUTE=route, RENORMALIZE=renormalize,
        BLOCK_T=triton.next_power_of_2(num_tokens) if route else 1,
        BLOCK_TOPK=triton.next_power_of_2(top_k), BLOCK_E=block_e, CHUNK=_ALIGN_CHUNK,
        num_warps=8 if block_e * max(num_tokens, 16) > 4096 else 4)
    return topk_weights, topk_ids, sorted_ids, counts, starts, active, num_active


def decode_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
               router_logits: torch.Tensor | None = None, top_k: int | None = None,
               renormalize: bool = True, topk_weights: torch.Tensor | None = None,
               topk_ids: torch.Tensor | None = None, config: dict[str, int] | None = None
               ) -> torch.Tensor:
    """sum_j w[t, j] * expert_{id[t, j]}(hidden[t]) with SiLU-gated experts, hidden [T, H],
    w13 [E, 2I, H] ([gate | up]), w2 [E, H, I] -> [T, H].

    Either router_logits [T, E] with top_k (softmax routing, renormalised when `renormalize`,
    as select_experts(scoring="softmax") does) or topk_weights / topk_ids [T, k] chosen by the
    caller. T * k must be at most MAX_PAIRS (`fits`). No host sync.
    """
    num_tokens, hidden_size = hidden.shape
    num_experts, size = w13.shape[0], w13.shape[1] // 2
    if router_logits is not None:
        if top_k is None or router_logits.shape != (num_tokens, num_experts):
            raise ValueError(f"decode_moe: router_logits {tuple(router_logits.shape)} must be "
                             f"[{num_tokens}, {num_experts}], with top_k")
    elif topk_weights is None or topk_ids is None:
        raise ValueError("decode_moe needs router_logits and top_k, or topk_weights and "
                         "topk_ids")
    else:
        top_k = topk_ids.shape[1]
        topk_ids = topk_ids.to(torch.int32).contiguous()
        topk_weights = topk_weights.float().contiguous()
    if not fits(num_tokens, top_k, num_experts):
        raise ValueError(f"decode_moe takes at most {MAX_PAIRS} (token, expert) pairs, got "
                         f"{num_tokens} x {top_k}")
    if not (hidden.dtype == w13.dtype == w2.dtype):
        raise ValueError(f"decode_moe: hidden {hidden.dtype}, w13 {w13.dtype} and w2 "
                         f"{w2.dtype} must share one dtype")
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("decode_moe needs expert weights with contiguous rows")
    hidden = hidden.contiguous()
    cfg = config or default_config(num_tokens * top_k)
    weights, ids, sorted_ids, counts, starts, active, num_active = _route_align(
        router_logits, topk_weights, topk_ids, num_tokens, top_k, num_experts, renormalize,
        hidden.device)
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    slots = min(num_tokens * top_k, num_experts)  # chosen experts, at most
    num_pairs = num_tokens * top_k
    act = torch.empty(num_pairs, size, dtype=hidden.dtype, device=hidden.device)
    _gate_up_kernel[(slots, triton.cdiv(size, cfg["gate_up_block_n"]))](
        hidden, w13, act, sorted_ids, counts, starts, active, num_active, hidden_size, size,
        hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0), TOP_K=top_k,
        BLOCK_M=cfg["block_m"], BLOCK_N=cfg["gate_up_block_n"], BLOCK_K=cfg["block_k"],
        DOT_PRECISION=precision, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    out = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _down_kernel[(slots, triton.cdiv(hidden_size, cfg["down_block_n"]))](
        act, w2, out, weights, sorted_ids, counts, starts, active, num_active, size,
        hidden_size, act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        BLOCK_M=cfg["block_m"], BLOCK_N=cfg["down_block_n"], BLOCK_K=cfg["block_k"],
        DOT_PRECISION=precision, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if top_k == 1:
        return out
    return out.view(num_tokens, top_k, hidden_size).sum(dim=1)


def route_and_align(router_logits: torch.Tensor, top_k: int, renormalize: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The route kernel alone: (weights [T, k] fp32, ids [T, k] int32), for tests."""
    num_tokens, num_experts = router_logits.shape
    weights, ids, *_ = _route_align(router_logits, None, None, num_tokens, top_k, num_experts,
                                    renormalize, router_logits.device)
    return weights, ids


def align(topk_ids: torch.Tensor, num_experts: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The align part alone: (sorted pair ids, counts, starts, chosen experts), for tests."""
    num_tokens, top_k = topk_ids.shape
    ids = topk_ids.to(torch.int32).contiguous()
    weights = torch.zeros(num_tokens, top_k, dtype=torch.float32, device=ids.device)
    _, _, sorted_ids, counts, starts, active, num_active = _route_align(
        None, weights, ids, num_tokens, top_k, num_experts, True, ids.device)
    return sorted_ids, counts, starts, active[:int(num_active.item())]
