"""Mixture-of-experts for decode-sized batches: routing and the experts in four launches.

At decode a MoE layer's cost is reading the chosen experts' weights (8 of 128 per token for
Qwen3-30B-A3B); the arithmetic is tiny. The general path (moe_aiter.py) spends ~40 small
launches per layer on routing and on sorting the (token, slot) pairs by expert, which under a
CUDA graph still cost a microsecond or more each, and its block-major grid reads an expert's
weights once per block of 16 pairs. Here a layer runs as

    [route]           softmax, top-k, renormalise (when the caller hands over the router
                      logits rather than chosen ids); route() also serves any batch
    [gate_up]         one program per (expert, BLOCK_N columns): finds the pairs that chose
                      its expert (a scan of the T * k ids; none: it stops there), lists them
                      for the down kernel, then their rows of x times [gate | up],
                      silu(gate) * up
    [down]            one program per (expert, BLOCK_N columns): act times down, times the
                      pair's routing weight
    [sum over k]      one program per (token, SUM_BLOCK_N columns), one warp: each token's k
                      weighted expert outputs added; left out with terms=True, for a caller
                      that adds them itself (the next RMSNorm, add_rms_norm.py), and with
                      fp32_sum=True, where the down kernel adds each pair's output into an
                      fp32 [T, H] sum with atomics instead (zeroed by the gate_up kernel) for
                      a caller that adds the residual to an fp32 row (RMSNorm, decode_gemv.py)

(with fewer pairs than experts, as at batch 1, the first grid axis walks pairs instead: program
p runs the expert of pair p unless an earlier pair chose it, so no program waits on the device
only to find that nobody chose its expert)

Each chosen expert's weights are read once per step however many tokens chose it (one row of
programs runs each distinct expert), so the step is bound by the distinct experts' bytes.
Nothing is sorted: an expert's program finds its own pairs. Every size the grid depends on is
known on the host from the token count, so a call captures in a CUDA graph. Each launch uses
programmatic dependent launch where it is on (pdl.py): a kernel starts while the previous one
drains and waits for it before its first read of anything that kernel wrote. At the smallest
batches the down kernel finds its expert and loads part of its weights before that wait
(DOWN_PRE_K), reading only the gate_up kernel's inputs.

Numerics: fp32 accumulation; gate and up are rounded to the activation dtype before
silu(gate) * up, as the unfused path stores them; each weighted expert output is rounded to the
activation dtype before the sum over k (as moe_aiter.py does). The fp32 sum adds the same
rounded outputs, in whatever order the atomics land: it equals the sum kernel's up to the order
of k fp32 additions.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.workers.ops.gpu.device_info import num_sms
from tandem.workers.ops.gpu.pdl import pdl_enabled, wait_for_previous_kernel

# Largest token count * top_k these kernels take: every expert program scans all the pairs'
# expert ids, and beyond about a thousand pairs AITER's grouped GEMMs are the better tool.
MAX_PAIRS = 1024
# Logits a routing program holds (tokens x experts): 16 tokens of 128 experts, 4 warps.
ROUTE_TILE = 2048
# Columns a sum-over-k program adds (one warp: [k, 256] values of one token).
SUM_BLOCK_N = 256
# fp32 sum values one gate_up program zeroes per store.
ZERO_BLOCK = 1024
# Rows of each down program's weight slab loaded before its PDL wait at decode's smallest
# batches (default_config): 256 of Qwen3-30B-A3B's 768 measured best on an H100; more held in
# registers slows the step (bench/RESULTS.md).
DOWN_PRE_K = 256
# Gate_up programs an SM gets at least, at decode's smallest batches (default_config): with
# fewer, some SMs idle or read twice the weight rows of others (Qwen3-30B-A3B's batch 1 at 64
# columns a program: 96 programs on an H100's 132 SMs); so the slab narrows from 64 columns
# until the programs reach this many per SM. Far more than that queue behind a first wave
# (its batch 2 at 16 columns: 768 programs) and slow the step (bench/RESULTS.md).
GATE_UP_PROGRAMS_PER_SM = 1.5


@triton.jit
def _route_rows(logits_ptr, stride_logits, rows, bias_ptr, scale, E, TOP_K: tl.constexpr,
                RENORMALIZE: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_E: tl.constexpr,
                BLOCK_TOPK: tl.constexpr):
    """Routing of the tokens `rows` [R] from their E logits each, as moe.select_experts:
    softmax or sigmoid scores; the choice is the score plus the correction bias (HAS_BIAS);
    with N_GROUP > 1 only the TOPK_GROUP best groups of BLOCK_E // N_GROUP experts are
    eligible (a group's score: its top two choices summed with a bias, else its best); the
    TOP_K best choices (ids int32 [R, BLOCK_TOPK], best first; ties to the lower id) weighted
    by their scores (fp32), renormalised (sigmoid: over the sum plus 1e-20), times scale."""
    experts = tl.arange(0, BLOCK_E)
    is_expert = (experts < E)[None, :]
    x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_logits + experts[None, :],
                mask=is_expert, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        score = tl.where(is_expert, 1.0 / (1.0 + tl.exp(-x)), -1.0)
    else:
        ex = tl.where(is_expert, tl.exp(x - tl.max(x, 1)[:, None]), 0.0)
        score = tl.where(is_expert, ex / tl.sum(ex, 1)[:, None], -1.0)
    choice = score
    if HAS_BIAS:
        bias = tl.load(bias_ptr + experts, mask=experts < E, other=0.0).to(tl.float32)
        choice = tl.where(is_expert, score + bias[None, :], float("-inf"))
    if N_GROUP > 1:  # BLOCK_E == E here: N_GROUP equal groups of consecutive experts
        grouped = tl.reshape(choice, [rows.shape[0], N_GROUP, BLOCK_E // N_GROUP])
        group_score = tl.max(grouped, 2)
        if HAS_BIAS:
            members = tl.arange(0, BLOCK_E // N_GROUP)[None, None, :]
            first = tl.argmax(grouped, 2)
            group_score += tl.max(tl.where(members == first[:, :, None], float("-inf"),
                                           grouped), 2)
        groups = tl.arange(0, N_GROUP)[None, :]
        eligible = tl.zeros([rows.shape[0], N_GROUP], tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            best_group = tl.argmax(group_score, 1)[:, None]
            eligible = tl.where(groups == best_group, 1, eligible)
            group_score = tl.where(groups == best_group, float("-inf"), group_score)
        choice = tl.reshape(tl.where(eligible[:, :, None] == 1, grouped, float("-inf")),
                            [rows.shape[0], BLOCK_E])
    slots = tl.arange(0, BLOCK_TOPK)[None, :]
    top_w = tl.zeros([rows.shape[0], BLOCK_TOPK], tl.float32)
    top_i = tl.zeros([rows.shape[0], BLOCK_TOPK], tl.int32)
    for j in tl.static_range(TOP_K):
        if HAS_BIAS:  # the choice is score + bias: gather the chosen expert's score
            best_1d = tl.argmax(choice, 1)
            weight = tl.sum(tl.where(experts[None, :] == best_1d[:, None], score, 0.0), 1)
        else:  # the choice is the score (-1 or -inf where never chosen), so one reduction
            # finds the best expert and its weight together
            weight, best_1d = tl.max(choice, 1, return_indices=True,
                                     return_indices_tie_break_left=True)
        best = best_1d[:, None]
        top_w = tl.where(slots == j, weight[:, None], top_w)
        top_i = tl.where(slots == j, best.to(tl.int32), top_i)
        choice = tl.where(experts[None, :] == best, float("-inf"), choice)
    if RENORMALIZE:
        total = tl.sum(top_w, 1)[:, None]
        top_w = top_w / (total + 1e-20) if SIGMOID else top_w / total
    return top_w * scale, top_i


@triton.jit(do_not_specialize=["T"])
def _route_kernel(logits_ptr, stride_logits, bias_ptr, scale, weights_ptr, ids_ptr, T, E,
                  TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, SIGMOID: tl.constexpr,
                  HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                  USE_PDL: tl.constexpr):
    """BLOCK_T tokens a program, each routed by _route_rows (weights fp32, ids int32, best
    first). Rows past T read the last token and store nothing."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    wait_for_previous_kernel(USE_PDL)  # the logits come from the router's GEMV
    top_w, top_i = _route_rows(logits_ptr, stride_logits, tl.minimum(tokens, T - 1), bias_ptr,
                               scale, E, TOP_K, RENORMALIZE, SIGMOID, HAS_BIAS, N_GROUP,
                               TOPK_GROUP, BLOCK_E, BLOCK_TOPK)
    slots = tl.arange(0, BLOCK_TOPK)[None, :]
    out = tokens.to(tl.int64)[:, None] * TOP_K + slots
    mask = (tokens < T)[:, None] & (slots < TOP_K)
    tl.store(weights_ptr + out, top_w, mask=mask)
    tl.store(ids_ptr + out, top_i, mask=mask)


@triton.jit
def _pairs_of_expert(ids_ptr, num_pairs, expert, sorted_ptr, WRITE: tl.constexpr,
                     BLOCK_P: tl.constexpr):
    """How many (token, slot) pairs chose `expert`; with WRITE, their flat pair ids in pair
    order go to sorted[expert * num_pairs + rank]. Every program of the expert writes the same
    values there, and reads back only after the barrier."""
    pairs = tl.arange(0, BLOCK_P)
    match = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1) == expert
    if WRITE:
        rank = tl.cumsum(match.to(tl.int32), 0) - 1
        tl.store(sorted_ptr + expert * num_pairs + rank, pairs, mask=match)
        tl.debug_barrier()
    return tl.sum(match.to(tl.int32), 0)


@triton.jit
def _program_expert(ids_ptr, BY_PAIR: tl.constexpr, BLOCK_P: tl.constexpr):
    """The expert program_id(0) runs, and 1 if it runs it (else 0). By expert: expert
    program_id(0). By pair: the expert of pair program_id(0), run by the program of the
    first pair that chose it (the others find an earlier pair with the same expert)."""
    if BY_PAIR:
        pair = tl.program_id(0)
        expert = tl.load(ids_ptr + pair)
        earlier = tl.arange(0, BLOCK_P)
        chosen_before = tl.load(ids_ptr + earlier, mask=earlier < pair, other=-1) == expert
        return expert, 1 - tl.max(chosen_before.to(tl.int32), 0)
    else:
        return tl.program_id(0), 1


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, act_ptr, ids_ptr, sorted_ptr, sum_ptr, sum_numel,
                    num_pairs, K, I, stride_x, stride_we, stride_wn, stride_act,
                    TOP_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BY_PAIR: tl.constexpr,
                    ZERO_SUM: tl.constexpr, ZERO_BLOCK: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    """act[pair, n] = silu(x[token] . w[e, n]) * (x[token] . w[e, I + n]) for the expert e of
    program_id(0) (_program_expert), the pairs that chose it, and BLOCK_N of the I columns.
    With ZERO_SUM the programs with program_id(0) == 0 also zero the fp32 sum [sum_numel] that
    the down kernel adds into (that kernel waits for this one to finish)."""
    wait_for_previous_kernel(USE_PDL)  # the ids come from the route kernel
    if ZERO_SUM:
        if tl.program_id(0) == 0:  # after the wait: earlier kernels may still read the memory
            offs = tl.program_id(1) * ZERO_BLOCK + tl.arange(0, ZERO_BLOCK)
            for start in range(0, sum_numel, tl.num_programs(1) * ZERO_BLOCK):
                tl.store(sum_ptr + start + offs, tl.zeros([ZERO_BLOCK], tl.float32),
                         mask=start + offs < sum_numel)
    expert, runs = _program_expert(ids_ptr, BY_PAIR, BLOCK_P)
    count = _pairs_of_expert(ids_ptr, num_pairs, expert, sorted_ptr, True, BLOCK_P) * runs
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    gate_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
    up_rows = gate_rows + I * stride_wn
    for m0 in range(0, count, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < count
        pairs = tl.load(sorted_ptr + expert * num_pairs + offs_m, mask=mask_m, other=0)
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
def _down_kernel(act_ptr, w_ptr, out_ptr, weights_ptr, ids_ptr, sorted_ptr, num_pairs, K, N,
                 stride_act, stride_we, stride_wn, stride_out, TOP_K: tl.constexpr,
                 BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, BY_PAIR: tl.constexpr, ACCUMULATE: tl.constexpr,
                 PRE_K: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    """out[pair, n] = weight[pair] * (act[pair] . w[e, n]) for the expert e of program_id(0)
    (_program_expert), the pairs that chose it (listed in sorted by the gate_up kernel), and
    BLOCK_N of the N (hidden) columns. With ACCUMULATE, out is the fp32 [T, N] sum instead:
    that value, rounded to the activation dtype, is atomically added to out[pair's token].

    PRE_K > 0: the program finds its expert and loads the first PRE_K rows of its weight slab
    before the PDL wait, so that part of the down weights streams while the gate_up kernel
    runs. The ids it reads then come from the route kernel (or the caller), which finished,
    its writes visible, before the gate_up kernel passed its own wait and let this kernel
    launch; the pair list and act, which gate_up writes, are read only after the wait."""
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    if PRE_K == 0:
        wait_for_previous_kernel(USE_PDL)  # act and the pair list come from the gate_up kernel
    expert, runs = _program_expert(ids_ptr, BY_PAIR, BLOCK_P)
    count = _pairs_of_expert(ids_ptr, num_pairs, expert, sorted_ptr, False, BLOCK_P) * runs
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
    if PRE_K > 0:
        offs_pre = tl.arange(0, PRE_K)
        rows_pre = K * tl.minimum(count, 1)  # nothing for a program whose expert is not run
        w_pre = tl.load(w_rows + offs_pre[:, None],
                        mask=(offs_pre < rows_pre)[:, None] & mask_n[None, :], other=0.0)
        wait_for_previous_kernel(USE_PDL)  # act and the pair list come from the gate_up kernel
    for m0 in range(0, count, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < count
        pairs = tl.load(sorted_ptr + expert * num_pairs + offs_m, mask=mask_m, other=0)
        a_rows = act_ptr + pairs.to(tl.int64)[:, None] * stride_act
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if PRE_K > 0:
            a_pre = tl.load(a_rows + offs_pre[None, :],
                            mask=mask_m[:, None] & (offs_pre < K)[None, :], other=0.0)
            acc = tl.dot(a_pre, w_pre, acc, input_precision=DOT_PRECISION)
        for k0 in range(PRE_K, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            a = tl.load(a_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                        other=0.0)
            w = tl.load(w_rows + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :],
                        other=0.0)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        routing_weight = tl.load(weights_ptr + pairs, mask=mask_m, other=0.0)
        y = (acc * routing_weight[:, None]).to(act_ptr.dtype.element_ty)
        mask = mask_m[:, None] & mask_n[None, :]
        if ACCUMULATE:
            rows = (pairs // TOP_K).to(tl.int64)[:, None] * stride_out
            tl.atomic_add(out_ptr + rows + offs_n[None, :], y.to(tl.float32), mask=mask,
                          sem="relaxed")
        else:
            tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_out + offs_n[None, :], y,
                     mask=mask)


@triton.jit
def _sum_slots_kernel(y_ptr, out_ptr, N, TOP_K: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                      BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr):
    """out[t, n] = sum over j of y[t * TOP_K + j, n], in fp32."""
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slots = tl.arange(0, BLOCK_TOPK)
    mask = (slots < TOP_K)[:, None] & (offs_n < N)[None, :]
    wait_for_previous_kernel(USE_PDL)  # y comes from the down kernel
    y = tl.load(y_ptr + (token * TOP_K + slots).to(tl.int64)[:, None] * N + offs_n[None, :],
                mask=mask, other=0.0)
    tl.store(out_ptr + token.to(tl.int64) * N + offs_n,
             tl.sum(y.to(tl.float32), 0).to(out_ptr.dtype.element_ty), mask=offs_n < N)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision for the expert GEMMs: exact fp32 (tests compare fp32 against
    torch); tf32 is unused for bf16 / fp16 inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"


def default_config(num_pairs: int, intermediate: int | None = None,
                   sm_count: int | None = None) -> dict[str, int]:
    """Block sizes and warps for the two expert kernels: the best of
    `python bench/probes/moe_layer.py` at Qwen3-30B-A3B's experts on an H200 (within a few
    percent of each other; 16-row blocks since decode experts see a handful of tokens each).
    Given the experts' intermediate size and the device's SM count, up to 16 pairs take the
    widest gate_up slab (64, 32 or 16 columns) that gives every SM GATE_UP_PROGRAMS_PER_SM
    programs, one per (pair, slab)."""
    block_n, stages = (64, 4) if num_pairs <= 16 else (32, 4) if num_pairs <= 64 else (64, 3)
    gate_up_block_n = block_n
    if num_pairs <= 16 and intermediate and sm_count:
        gate_up_block_n = next(
            (n for n in (64, 32) if num_pairs * triton.cdiv(intermediate, n)
             >= GATE_UP_PROGRAMS_PER_SM * sm_count), 16)
    return {"block_m": 16, "gate_up_block_n": gate_up_block_n, "down_block_n": block_n,
            "block_k": 128, "down_block_k": 128, "num_warps": 4, "num_stages": stages,
            "down_pre_k": DOWN_PRE_K if num_pairs <= 16 else 0}


def fits(num_tokens: int, top_k: int) -> bool:
    """Whether this path takes the batch: at most MAX_PAIRS (token, slot) pairs."""
    return 0 < num_tokens * top_k <= MAX_PAIRS


def route_supported(num_experts: int, n_group: int | None = None) -> bool:
    """Whether route() takes this routing: grouped routing needs a power-of-two expert count
    (the groups are one reshape of the tile)."""
    return not n_group or n_group <= 1 or (
        num_experts == triton.next_power_of_2(num_experts) and num_experts % n_group == 0)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, *,
          scoring: str = "softmax", e_score_correction_bias: torch.Tensor | None = None,
          n_group: int | None = None, topk_group: int | None = None,
          routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """moe.select_experts on the GPU in one launch: router_logits [T, E] -> (weights [T, k]
    fp32, ids [T, k] int32, best first), the same arguments (grouped routing where
    route_supported). A program routes up to ROUTE_TILE // E tokens (one at a time in
    decode's single-token steps), so a prefill's thousands of tokens are a few hundred
    programs, not one each. A lone token's program is one warp: its softmax and k argmaxes
    then reduce within the warp, with no round trip through shared memory per reduction."""
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring={scoring!r} is not 'softmax' or 'sigmoid'")
    num_tokens, num_experts = router_logits.shape
    if not route_supported(num_experts, n_group):
        raise ValueError(f"route: {num_experts} experts in n_group={n_group} groups need a "
                         "power-of-two expert count that the groups divide")
    block_e = triton.next_power_of_2(num_experts)
    block_t = min(triton.next_power_of_2(num_tokens), max(1, ROUTE_TILE // block_e))
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    groups = n_group if n_group and n_group > 1 else 1
    has_bias = e_score_correction_bias is not None
    pdl = pdl_enabled(router_logits.device)
    _route_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits, router_logits.stride(0),
        e_score_correction_bias if has_bias else router_logits, float(routed_scaling_factor),
        weights, ids, num_tokens, num_experts, TOP_K=top_k, RENORMALIZE=renormalize,
        SIGMOID=scoring == "sigmoid", HAS_BIAS=has_bias, N_GROUP=groups,
        TOPK_GROUP=(topk_group or groups) if groups > 1 else 1, BLOCK_T=block_t,
        BLOCK_E=block_e, BLOCK_TOPK=triton.next_power_of_2(top_k), USE_PDL=pdl,
        launch_pdl=pdl, num_warps=1 if block_t == 1 else 4)
    return weights, ids


def decode_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
               router_logits: torch.Tensor | None = None, top_k: int | None = None,
               renormalize: bool = True, topk_weights: torch.Tensor | None = None,
               topk_ids: torch.Tensor | None = None, config: dict[str, int] | None = None,
               terms: bool = False, fp32_sum: bool = False) -> torch.Tensor:
    """sum_j w[t, j] * expert_{id[t, j]}(hidden[t]) with SiLU-gated experts, hidden [T, H],
    w13 [E, 2I, H] ([gate | up]), w2 [E, H, I] -> [T, H].

    Either router_logits [T, E] with top_k (softmax routing, renormalised when `renormalize`,
    as select_experts(scoring="softmax") does) or topk_weights / topk_ids [T, k] chosen by the
    caller. T * k must be at most MAX_PAIRS (`fits`). No host sync. With terms the last
    launch (the sum over k) is left out: [T, k, H], token t's k weighted expert outputs in
    slot order, for a caller that adds them up itself (RMSNorm with a residual). With fp32_sum
    the down kernel adds them into an fp32 [T, H] (no sum launch), for a caller that rounds
    that row to the activation dtype and adds the residual (RMSNorm, fused_gemv).
    """
    if terms and fp32_sum:
        raise ValueError("decode_moe: terms and fp32_sum are two different outputs; pick one")
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
    if not fits(num_tokens, top_k):
        raise ValueError(f"decode_moe takes at most {MAX_PAIRS} (token, expert) pairs, got "
                         f"{num_tokens} x {top_k}")
    if not (hidden.dtype == w13.dtype == w2.dtype):
        raise ValueError(f"decode_moe: hidden {hidden.dtype}, w13 {w13.dtype} and w2 "
                         f"{w2.dtype} must share one dtype")
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("decode_moe needs expert weights with contiguous rows")
    if router_logits is not None:
        topk_weights, topk_ids = route(router_logits, top_k, renormalize)
    else:
        topk_ids = topk_ids.to(torch.int32).contiguous()
        topk_weights = topk_weights.float().contiguous()
    hidden = hidden.contiguous()
    num_pairs = num_tokens * top_k
    cfg = config or default_config(num_pairs, size,
                                   num_sms(hidden.device) if hidden.is_cuda else None)
    block_p = triton.next_power_of_2(num_pairs)
    precision = dot_precision(hidden.dtype)
    device = hidden.device
    pdl = pdl_enabled(device)
    sorted_ids = torch.empty(num_experts * num_pairs, dtype=torch.int32, device=device)
    act = torch.empty(num_pairs, size, dtype=hidden.dtype, device=device)
    by_pair = cfg.get("by_pair", num_pairs < num_experts)
    programs = num_pairs if by_pair else num_experts
    if fp32_sum:  # zeroed by the gate_up kernel
        pair_out = torch.empty(num_tokens, hidden_size, dtype=torch.float32, device=device)
    else:
        pair_out = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=device)
    _gate_up_kernel[(programs, triton.cdiv(size, cfg["gate_up_block_n"]))](
        hidden, w13, act, topk_ids, sorted_ids, pair_out, pair_out.numel(), num_pairs,
        hidden_size, size, hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_P=block_p, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["gate_up_block_n"],
        BLOCK_K=cfg["block_k"], BY_PAIR=by_pair, ZERO_SUM=fp32_sum, ZERO_BLOCK=ZERO_BLOCK,
        DOT_PRECISION=precision, USE_PDL=pdl, launch_pdl=pdl, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    _down_kernel[(programs, triton.cdiv(hidden_size, cfg["down_block_n"]))](
        act, w2, pair_out, topk_weights, topk_ids, sorted_ids, num_pairs, size, hidden_size,
        act.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0), TOP_K=top_k,
        BLOCK_P=block_p, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["down_block_n"],
        BLOCK_K=cfg["down_block_k"], BY_PAIR=by_pair, ACCUMULATE=fp32_sum,
        PRE_K=cfg.get("down_pre_k", 0), DOT_PRECISION=precision, USE_PDL=pdl, launch_pdl=pdl,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if fp32_sum:
        return pair_out
    if terms:
        return pair_out.view(num_tokens, top_k, hidden_size)
    if top_k == 1:
        return pair_out
    out = torch.empty(num_tokens, hidden_size, dtype=hidden.dtype, device=device)
    _sum_slots_kernel[(num_tokens, triton.cdiv(hidden_size, SUM_BLOCK_N))](
        pair_out, out, hidden_size, TOP_K=top_k, BLOCK_TOPK=triton.next_power_of_2(top_k),
        BLOCK_N=SUM_BLOCK_N, USE_PDL=pdl, launch_pdl=pdl, num_warps=1)
    return out
