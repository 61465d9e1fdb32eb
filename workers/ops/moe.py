"""Mixture of experts: routing (`select_experts`) and the experts themselves (`FusedMoE`).

Expert weights are stacked so one kernel call can run every expert:

    w13 [E, 2*I, H]   rows [0, I) are gate (checkpoint "w1"), rows [I, 2I) are up ("w3")
    w2  [E, H, I]     down ("w2")

Under tensor parallelism every rank holds all E experts with its slice of I (w13 rows, w2
columns) and the partial outputs are all-reduced, as in RowParallelLinear. Under expert
parallelism (workers/parallel/context.py) rank r holds experts [r*E/N, (r+1)*E/N) whole; tokens
reach their experts' ranks through an `ExpertDispatcher` (workers/parallel/expert_dispatch.py)
and each rank runs its experts on the (token, expert) pairs it owns.

Kernel seam: `FusedMoE` picks a `fused_moe(hidden, w13, w2, topk_weights, topk_ids, ...)`
function once, at construction. The torch one sorts the (token, slot) pairs by expert and
runs one matmul pair per expert that has tokens. The "aiter-triton" one
(`aiter_triton_fused_moe`, AITER's `aiter.ops.triton.moe_op`, loaded by `aiter_compat`) groups
the pairs by expert on the GPU (`align_by_expert`: padded to the kernel's block size) and then
makes one `fused_moe` launch per projection. On aiter-triton, batches of at most
`DECODE_MAX_PAIRS` (token, slot) pairs take our decode kernels instead
(workers/ops/gpu/moe_decode.py: routing, grouping and both projections in four launches, each
chosen expert's weights read once); `FusedMoE.forward_logits` lets softmax-routed models hand
over the router logits so the routing joins that path. Larger batches take AITER's fused_moe,
or, when the `moe_prefill` kernel option turns them on and the expert sizes are multiples of
8, our prefill kernels (workers/ops/gpu/moe_prefill.py: the grouping in three launches, then
grouped GEMMs with SiLU-and-mul fused into gate_up).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.workers.ops import kernel_options
from tandem.workers.ops.backend import KernelBackend
from tandem.workers.ops.moe_aiter import aiter_triton_fused_moe, check_aiter_triton_args
from tandem.workers.ops.linear import tp_rank_and_size
from tandem.workers.parallel.context import current_parallel
from tandem.workers.parallel.expert_dispatch import make_dispatcher
from tandem.workers.parallel.all_reduce import tp_all_reduce

# At most this many (token, slot) pairs take the decode kernels (moe_decode.py, whose MAX_PAIRS
# bounds it) on aiter-triton; larger batches take AITER's grouped fused_moe. Up to 128 tokens
# x top-8 the decode kernels measure faster (bench/probes/moe_layer.py).
DECODE_MAX_PAIRS = 1024

# Checkpoint shard ids: which projection of one expert a tensor holds.
GATE, UP, DOWN = "w1", "w3", "w2"
STACKED_GATE_UP = "w13"  # a tensor holding [gate | up] of every expert: [E, 2I, H]


# ---- routing ---------------------------------------------------------------------------------

def select_experts(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax",
                   renormalize: bool, e_score_correction_bias: torch.Tensor | None = None,
                   n_group: int | None = None, topk_group: int | None = None,
                   routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick top_k experts per token: router_logits [T, E] -> (weights [T, k] fp32, ids [T, k]).

    scoring="softmax" (Mixtral, Qwen2/3-MoE, DeepSeek-V2): softmax over all experts, top-k,
    optionally renormalised to sum to 1. scoring="sigmoid" (DeepSeek-V3, GLM-4-MoE): sigmoid
    scores; `e_score_correction_bias` is added for *choosing* experts only, the weights are the
    unbiased scores. With n_group, experts are split into n_group equal groups, only the
    topk_group best groups are eligible (group score: sum of its top two biased scores when
    a correction bias is given, else its best score), then top-k among them. The weights are
    multiplied by routed_scaling_factor last. Ids come out in no particular order.
    """
    if scoring == "softmax":
        scores = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    elif scoring == "sigmoid":
        scores = torch.sigmoid(router_logits.float())
    else:
        raise ValueError(f"scoring={scoring!r} is not 'softmax' or 'sigmoid'")
    choice = scores if e_score_correction_bias is None else \
        scores + e_score_correction_bias.float()
    if n_group is not None and n_group > 1:
        choice = _mask_to_best_groups(choice, n_group, topk_group or n_group,
                                      use_top2_sum=e_score_correction_bias is not None)
    topk_ids = torch.topk(choice, top_k, dim=-1, sorted=False).indices  # [T, k]
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        denominator = topk_weights.sum(dim=-1, keepdim=True)
        if scoring == "sigmoid":
            denominator = denominator + 1e-20  # sigmoid scores can all be ~0
        topk_weights = topk_weights / denominator
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids


def _mask_to_best_groups(choice: torch.Tensor, n_group: int, topk_group: int,
                         use_top2_sum: bool) -> torch.Tensor:
    num_tokens, num_experts = choice.shape
    if num_experts % n_group:
        raise ValueError(f"n_group={n_group} does not divide the {num_experts} experts")
    grouped = choice.view(num_tokens, n_group, num_experts // n_group)  # [T, G, E/G]
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1) if use_top2_sum \
        else grouped.max(dim=-1).values  # [T, G]
    best_groups = torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices
    is_eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    return grouped.masked_fill(~is_eligible.unsqueeze(-1), float("-inf")).view_as(choice)


# ---- experts: kernels ------------------------------------------------------------------------

# Expert activations over the two halves of x W13^T (gate, up), by name:
#   "silu"       SiLU(gate) * up
#   "swigluoai"  GPT-OSS's clamped SwiGLU: gate clamped to <= limit, up to [-limit, limit],
#                then (up + 1) * gate * sigmoid(alpha * gate)
ACTIVATIONS = ("silu", "swigluoai")


def _gated(gate: torch.Tensor, up: torch.Tensor, activation: str, swiglu_alpha: float,
           swiglu_limit: float) -> torch.Tensor:  # [n, I], [n, I] -> [n, I]
    if activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=swiglu_limit)
    up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * swiglu_alpha))


def torch_fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                    w13_bias: torch.Tensor | None = None,
                    w2_bias: torch.Tensor | None = None, activation: str = "silu",
                    swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]) for every token t.

    hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_* [T, k] -> [T, H]. Each expert is
    act(x W1^T, x W3^T) then W2 (see `ACTIVATIONS`). Experts are visited in id order, so each
    token's terms are added in ascending expert id (what transformers does).
    """
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)  # [T*k]: slot s belongs to token s // k
    order = torch.argsort(flat_ids, stable=True)  # slots grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    flat_weights = topk_weights.reshape(-1)
    out = torch.zeros_like(hidden)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start:start + count]
        start += count
        tokens = slots // top_k
        gate, up = F.linear(hidden[tokens], w13[expert],
                            None if w13_bias is None else w13_bias[expert]).chunk(2, dim=-1)
        y = F.linear(_gated(gate, up, activation, swiglu_alpha, swiglu_limit), w2[expert],
                     None if w2_bias is None else w2_bias[expert])  # [n, H]
        out.index_add_(0, tokens, y * flat_weights[slots, None].to(y.dtype))
    return out


def prefill_kernels_fused_moe(*args: object, **kwargs: object) -> torch.Tensor:
    """moe_prefill.prefill_fused_moe (our grouped GEMMs), imported on first call: it needs
    triton, which a CPU box may lack."""
    from tandem.workers.ops.gpu.moe_prefill import prefill_fused_moe
    return prefill_fused_moe(*args, **kwargs)


def _prefill_kernels_take(hidden_size: int, intermediate_size: int) -> bool:
    """Whether moe_prefill's tensor descriptors take experts of this shape in any dtype the
    kernels run (2- and 4-byte elements)."""
    from tandem.workers.ops.gpu.moe_prefill import rows_aligned  # needs triton
    return rows_aligned(hidden_size, intermediate_size, element_size=2)


# The aiter-triton kernel (CUDA and ROCm) lives in moe_aiter.py; on aiter-triton the
# `moe_prefill` kernel option swaps in prefill_kernels_fused_moe (same contract).
FusedMoEKernel = Callable[..., torch.Tensor]
_KERNELS: dict[KernelBackend, FusedMoEKernel] = {KernelBackend.TORCH: torch_fused_moe,
                                                 KernelBackend.AITER_TRITON: aiter_triton_fused_moe}


# ---- experts: the module ---------------------------------------------------------------------

class FusedMoE(nn.Module):
    """E experts with gated MLPs (`activation`, see `ACTIVATIONS`), weights stacked as
    w13 [E, 2I, H] and w2 [E, H, I].

    Loading: `weight_loader(param, tensor, shard_id, expert_id)` takes one expert's checkpoint
    tensor (shard "w1" gate, "w3" up, "w2" down; [I, H] / [H, I], or [I] / [H] for biases), or a
    tensor stacked over all experts ([E, 2I, H] gate|up or [E, I, H] / [E, H, I]), from which it
    copies expert `expert_id`'s part. Every parameter lists the (expert_id, shard_id) pairs it
    needs in `shard_ids` (`num_shards` = their number) so a loader can name what is missing.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 bias: bool = False, activation: str = "silu", swiglu_alpha: float = 1.702,
                 swiglu_limit: float = 7.0,
                 backend: KernelBackend = KernelBackend.TORCH) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not supported (only "
                             f"{', '.join(map(repr, ACTIVATIONS))})")
        # Passed to the kernel only when not SiLU, so SiLU calls are what they always were.
        self._activation_kwargs = {} if activation == "silu" else dict(
            activation=activation, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
        self.num_experts = num_experts  # in the model; expert ids are always global
        self._init_parallel()
        if intermediate_size % self.tp_size:
            raise ValueError(f"moe intermediate_size={intermediate_size} is not divisible by "
                             f"the TP size {self.tp_size}")
        self.intermediate_size = intermediate_size // self.tp_size  # on this rank
        size, local = self.intermediate_size, self.num_local_experts
        self.w13 = self._parameter((local, 2 * size, hidden_size), (GATE, UP))
        self.w2 = self._parameter((local, hidden_size, size), (DOWN,))
        self.w13_bias = self._parameter((local, 2 * size), (GATE, UP)) if bias else None
        self.w2_bias = self._parameter((local, hidden_size), (DOWN,)) if bias else None
        if backend is KernelBackend.AITER_TRITON:
            check_aiter_triton_args(activation, bias)
            from tandem.workers.ops.aiter_compat import load_aiter_triton
            try:
                load_aiter_triton()  # fail at construction, not at the first forward
            except ImportError as e:
                raise ValueError(f"fused_moe: kernel backend 'aiter-triton' is unavailable: "
                                 f"{e}") from e
        self.backend = backend
        options = kernel_options.current()
        self._fused_moe = prefill_kernels_fused_moe if (
            backend is KernelBackend.AITER_TRITON and options.moe_prefill
            and _prefill_kernels_take(hidden_size, size)) else _KERNELS[backend]
        # forward(summed=False) may return terms from our kernels on one rank: under TP the
        # all-reduce would carry k times the bytes; expert parallelism combines sums.
        self._leaves_terms = self.tp_size == 1 and self.dispatcher is None
        # Batches of up to this many (token, slot) pairs take the decode kernels; 0: none.
        self.decode_max_pairs = DECODE_MAX_PAIRS if (
            backend is KernelBackend.AITER_TRITON and self.dispatcher is None
            and options.moe_decode) else 0

    def _init_parallel(self) -> None:
        """TP: every expert, a 1/tp slice of I (tp_rank, tp_size). EP: whole experts
        [first_local_expert, + num_local_experts), and tp_size 1 for the slicing of I."""
        context = current_parallel()
        self.dispatcher = None
        if not context.is_expert_parallel:
            self.tp_rank, self.tp_size = tp_rank_and_size()
            self.first_local_expert, self.num_local_experts = 0, self.num_experts
            return
        ep_rank, ep_size = context.tp_rank, context.tp_size
        if self.num_experts % ep_size:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by the expert "
                             f"parallel size {ep_size}")
        self.tp_rank, self.tp_size = 0, 1
        self.num_local_experts = self.num_experts // ep_size
        self.first_local_expert = ep_rank * self.num_local_experts
        self.dispatcher = make_dispatcher(self.num_experts, ep_rank, ep_size)

    def _parameter(self, shape: tuple[int, ...], shards: tuple[str, ...]) -> nn.Parameter:
        param = nn.Parameter(torch.empty(shape), requires_grad=False)
        param.weight_loader = self.weight_loader
        first = self.first_local_expert  # shard ids name global expert ids
        param.shard_ids = [(first + expert, shard) for expert in range(shape[0])
                           for shard in shards]
        param.num_shards = len(param.shard_ids)
        return param

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str,
                      expert_id: int) -> None:
        if shard_id not in (GATE, UP, DOWN):
            raise ValueError(f"fused moe: shard_id={shard_id!r} is not 'w1', 'w3' or 'w2'")
        if not isinstance(expert_id, int) or not 0 <= expert_id < self.num_experts:
            raise ValueError(f"fused moe: expert_id={expert_id!r} not in [0, {self.num_experts})")
        what = f"expert {expert_id} shard {shard_id}"
        is_w13 = param is self.w13 or param is self.w13_bias
        if is_w13 == (shard_id == DOWN):
            raise ValueError(f"{what}: shard {shard_id!r} does not belong in this parameter")
        local_id = expert_id - self.first_local_expert
        if not 0 <= local_id < self.num_local_experts:
            return  # another expert-parallel rank holds this expert
        if loaded.dim() == param.dim():  # stacked over all experts
            if loaded.shape[0] != self.num_experts:
                raise ValueError(f"{what}: expected {self.num_experts} stacked experts, "
                                 f"checkpoint has shape {tuple(loaded.shape)}")
            loaded = loaded[expert_id]
            full = self.intermediate_size * self.tp_size
            if is_w13 and loaded.shape[0] == 2 * full:  # [gate | up] of this expert
                loaded = loaded.narrow(0, 0 if shard_id == GATE else full, full)
        dst = param.data[local_id]
        size = self.intermediate_size
        if is_w13:  # rows [0, I) gate, [I, 2I) up; this rank's slice of I
            dst = dst.narrow(0, 0 if shard_id == GATE else size, size)
            loaded = self._rank_slice(loaded, 0)
        elif dst.dim() == 2:  # w2 weight: this rank's slice of the I columns (a bias is whole)
            loaded = self._rank_slice(loaded, 1)
        if tuple(dst.shape) != tuple(loaded.shape):
            raise ValueError(f"{what}: expected shape {tuple(dst.shape)}, checkpoint has "
                             f"{tuple(loaded.shape)}")
        dst.copy_(loaded)

    def _rank_slice(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        size = self.intermediate_size
        if self.tp_size > 1 and loaded.dim() > dim and loaded.shape[dim] == size * self.tp_size:
            return loaded.narrow(dim, self.tp_rank * size, size)
        return loaded

    @property
    def supports_cuda_graphs(self) -> bool:
        """The torch backend loops over the experts that tokens chose, and expert parallelism
        sizes its all-to-all from counts read back to the host: host-side decisions both."""
        return self.backend is KernelBackend.AITER_TRITON and self.dispatcher is None

    def _takes_decode_path(self, num_tokens: int, top_k: int) -> bool:
        return 0 < num_tokens * top_k <= self.decode_max_pairs

    def forward_logits(self, hidden: torch.Tensor, router_logits: torch.Tensor, *, top_k: int,
                       renormalize: bool, summed: bool = True) -> torch.Tensor:
        """Softmax top-k routing (`select_experts(scoring="softmax")`), then the experts: a
        small batch routes inside the decode kernels' launches, a larger one through select.
        [T, H], [T, E] -> [T, H], or terms [T, k, H] (`forward`, summed=False)."""
        if self._takes_decode_path(hidden.shape[0], top_k):
            return self._decode_kernels(hidden, summed, router_logits=router_logits,
                                        top_k=top_k, renormalize=renormalize)
        return self(hidden, *self.select(router_logits, top_k, renormalize=renormalize),
                    summed=summed)

    def select(self, router_logits: torch.Tensor, top_k: int, **routing: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """select_experts(router_logits, top_k, **routing). On aiter-triton without expert
        parallelism it is one launch of moe_decode.route (where that takes the routing), not
        torch's five to fifteen small ops."""
        if self.backend is KernelBackend.AITER_TRITON and self.dispatcher is None \
                and router_logits.is_cuda:
            from tandem.workers.ops.gpu.moe_decode import route, route_supported  # triton
            if route_supported(router_logits.shape[1], routing.get("n_group")):
                return route(router_logits, top_k, **routing)
        return select_experts(router_logits, top_k, **routing)

    def _decode_kernels(self, hidden: torch.Tensor, summed: bool, **routing: object
                        ) -> torch.Tensor:
        """moe_decode.decode_moe over this rank's experts (`routing`: router logits and top_k,
        or the chosen weights and ids), all-reduced under TP; where `forward` allows, terms,
        or for a single token its fp32 sum (added by the down kernel: no sum launch, and a row
        that decode_gemv's fused add + norm takes as it takes a summed one)."""
        from tandem.workers.ops.gpu.moe_decode import decode_moe  # needs triton
        unsummed = not summed and self._leaves_terms
        single = hidden.shape[0] == 1
        return self._reduced(decode_moe(hidden, self.w13, self.w2, terms=unsummed and not single,
                                        fp32_sum=unsummed and single, **routing))

    def _reduced(self, out: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            tp_all_reduce(out)
        return out

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, *, summed: bool = True) -> torch.Tensor:
        """hidden [T, H], topk_weights / topk_ids [T, k] -> [T, H]: each token's weighted sum
        of its experts' outputs. summed=False lets our kernels (`moe_decode`,
        `moe_prefill`) on one rank without expert parallelism return the k weighted outputs
        unsummed, [T, k, H], for a caller that adds them up itself (RMSNorm with a residual
        does, in the same pass as the add). A single token never gets terms: on the decode
        kernels its sum comes as one fp32 row [1, H] (which RMSNorm and decode_gemv's fused add
        + norm round to the residual's dtype). Every other path returns [T, H] in the
        activation dtype."""
        if self._takes_decode_path(hidden.shape[0], topk_ids.shape[1]):
            return self._decode_kernels(hidden, summed, topk_weights=topk_weights,
                                        topk_ids=topk_ids)
        if self.dispatcher is not None:
            dispatched = self.dispatcher.dispatch(hidden, topk_ids, topk_weights)
            out = self._run_local_experts(dispatched.hidden, dispatched.topk_weights,
                                          dispatched.topk_ids)
            return self.dispatcher.combine(out, dispatched)
        # Only our prefill kernels take `terms`; AITER's fused_moe and the torch loop sum. A
        # single token's output stays one row: its consumer may be decode_gemv's fused add +
        # norm, which takes no terms.
        leave_terms = (not summed and self._leaves_terms and hidden.shape[0] > 1
                       and self._fused_moe is prefill_kernels_fused_moe)
        out = self._fused_moe(hidden, self.w13, self.w2, topk_weights, topk_ids,
                              w13_bias=self.w13_bias,
                              w2_bias=self.w2_bias if self.tp_rank == 0 else None,  # added once
                              **self._activation_kwargs, **({"terms": True} if leave_terms
                                                           else {}))
        return self._reduced(out)

    def _run_local_experts(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                           topk_ids: torch.Tensor) -> torch.Tensor:
        """Expert parallel: sum of this rank's experts' weighted outputs per token, [R, H].

        The (token, slot) pairs whose expert lives here run through the kernel as top-1
        tokens, in ascending expert id, so each token's terms add in that order (as one
        rank's kernel would add them)."""
        local_ids = topk_ids - self.first_local_expert  # [R, k]
        is_here = (local_ids >= 0) & (local_ids < self.num_local_experts)
        rows, slots = is_here.nonzero(as_tuple=True)  # [P]
        pair_ids = local_ids[rows, slots]
        order = torch.argsort(pair_ids, stable=True)
        rows, slots, pair_ids = rows[order], slots[order], pair_ids[order]
        pair_out = self._fused_moe(hidden[rows], self.w13, self.w2,
                                   topk_weights[rows, slots].unsqueeze(1), pair_ids.unsqueeze(1),
                                   w13_bias=self.w13_bias, w2_bias=self.w2_bias,
                                   **self._activation_kwargs)  # [P, H]
        return torch.zeros_like(hidden).index_add_(0, rows, pair_out)


def expert_targets(experts_prefix: str, shard_id: str, expert_id: int | None,
                   num_experts: int, is_bias: bool = False) -> list[tuple[str, str, int]]:
    """Where one checkpoint expert tensor goes, as (parameter name, shard id, expert id).

    `experts_prefix` names the FusedMoE module ("model.layers.3.mlp.experts"). shard_id is
    "w1" / "w3" / "w2" for one expert's tensor; with expert_id None the tensor is stacked over
    all experts: "w13" for [gate | up] of each, "w2" for down.
    """
    suffix = "_bias" if is_bias else ""
    if expert_id is not None:
        param = "w2" if shard_id == DOWN else "w13"
        return [(f"{experts_prefix}.{param}{suffix}", shard_id, expert_id)]
    if shard_id == STACKED_GATE_UP:
        return [(f"{experts_prefix}.w13{suffix}", shard, expert)
                for expert in range(num_experts) for shard in (GATE, UP)]
    return [(f"{experts_prefix}.w2{suffix}", DOWN, expert) for expert in range(num_experts)]
