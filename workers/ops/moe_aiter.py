"""FusedMoE's aiter-triton kernel: AITER's Triton `fused_moe`, one launch per projection.

The (token, slot) pairs are grouped by expert on the GPU (`align_by_expert`, our own torch code:
AITER's moe_align_block_size_triton recompiles per token count and leaves padding slots
unwritten), padded to the kernel's block size, then gate_up and down each run as one launch.
Same contract as moe.torch_fused_moe; SiLU only, no expert biases.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

def aiter_moe_config(num_tokens: int, top_k: int, num_experts: int) -> dict[str, int]:
    """Block sizes for AITER's `fused_moe` kernel, by the mean number of (token, slot) pairs
    per expert. AITER's own tuned tables are for AMD GPUs; these are the best of a handful of
    configs timed under a CUDA graph on an H100 at Qwen3-30B-A3B's shape (E=128, top-8,
    H=2048, I=768), not tuned further."""
    pairs_per_expert = num_tokens * top_k / num_experts
    if pairs_per_expert <= 16:  # decode: mostly weight reads, one 16-row block per expert
        return dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1,
                    num_warps=4, num_stages=4)
    if pairs_per_expert <= 128:
        return dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=8,
                    num_warps=8, num_stages=3)
    return dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=8,
                num_warps=8, num_stages=3)


def padded_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the padded length of the pairs sorted by expert, known on the host:
    every pair, plus at most block_m - 1 padding slots for each expert that can have pairs,
    rounded up to block_m."""
    capacity = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return (capacity + block_m - 1) // block_m * block_m


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the (token, slot) pairs by expert, each expert's run padded to block_m, as
    AITER's `fused_moe` reads them. topk_ids [T, k] ->
      sorted_ids [P] int32: flat slot ids (t * k + j), expert by expert; padding = T * k
      expert_ids [P / block_m] int32: the expert of each block of block_m entries
      num_post_pad [1] int32: used length of sorted_ids (a multiple of block_m)
    P = padded_capacity(T * k, num_experts, block_m), so nothing here waits for the device.
    Plain torch (stable sort): unlike AITER's moe_align_block_size_triton, no kernel is
    recompiled for each new token count.
    """
    flat = topk_ids.reshape(-1).long()
    num_slots = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)  # [E]
    padded_starts = padded_ends - padded
    count_starts = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, in slot order
    expert_of = flat[order]
    rank = torch.arange(num_slots, device=device) - count_starts[expert_of]
    capacity = padded_capacity(num_slots, num_experts, block_m)
    sorted_ids = torch.full((capacity,), num_slots, dtype=torch.int32, device=device)
    sorted_ids[padded_starts[expert_of] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=device)
    expert_ids = torch.searchsorted(padded_ends, block_starts, right=True)
    expert_ids = expert_ids.clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, padded_ends[-1:].to(torch.int32)


def check_aiter_triton_args(activation: str, has_bias: bool) -> None:
    if activation != "silu":
        raise ValueError(f"fused_moe: kernel backend 'aiter-triton' supports activation='silu' "
                         f"only, not {activation!r}; use backend 'torch'")
    if has_bias:
        raise ValueError("fused_moe: kernel backend 'aiter-triton' does not support expert "
                         "biases; use backend 'torch'")


def aiter_triton_fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                           topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                           w13_bias: torch.Tensor | None = None,
                           w2_bias: torch.Tensor | None = None, activation: str = "silu",
                           config: dict[str, int] | None = None, **_: object) -> torch.Tensor:
    """`torch_fused_moe` on AITER's Triton `fused_moe` kernel (one launch per projection).

    SiLU only, no biases. hidden, w13 and w2 share one dtype (bf16, fp16 or fp32). `config`
    overrides the block sizes (`aiter_moe_config`). Each token's k weighted expert outputs are
    rounded to the hidden dtype, then summed. No host sync: a call can be captured in a CUDA
    graph (eager calls are bound by the host's launch cost: ~30 small torch ops align the
    pairs by expert).
    """
    check_aiter_triton_args(activation, w13_bias is not None or w2_bias is not None)
    from tandem.workers.ops.aiter_compat import load_aiter_triton

    aiter = load_aiter_triton()
    if not (hidden.dtype == w13.dtype == w2.dtype):
        raise ValueError(f"fused_moe (aiter-triton): hidden {hidden.dtype}, w13 {w13.dtype} and "
                         f"w2 {w2.dtype} must share one dtype")
    compute_type = {torch.bfloat16: aiter.tl.bfloat16, torch.float16: aiter.tl.float16,
                    torch.float32: aiter.tl.float32}.get(hidden.dtype)
    if compute_type is None:
        raise ValueError(f"fused_moe (aiter-triton): dtype {hidden.dtype} is not supported")
    num_tokens, hidden_size = hidden.shape
    num_experts, size = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    config = dict(config or aiter_moe_config(num_tokens, top_k, num_experts))
    sorted_ids, expert_ids, num_post_pad = align_by_expert(topk_ids, num_experts,
                                                           config["BLOCK_SIZE_M"])
    weights = topk_weights.float().contiguous()
    ids = topk_ids.contiguous()
    hidden = hidden.contiguous()
    gate_up = torch.empty(num_tokens, top_k, 2 * size, dtype=hidden.dtype, device=hidden.device)
    aiter.fused_moe(hidden, w13, gate_up, None, None, None, weights, ids, sorted_ids,
                    expert_ids, num_post_pad, False, top_k, compute_type, False, False, False,
                    None, config)
    act = F.silu(gate_up[..., :size]) * gate_up[..., size:]  # [T, k, I]
    down = torch.empty(num_tokens, top_k, hidden_size, dtype=hidden.dtype,
                       device=hidden.device)
    aiter.fused_moe(act.view(num_tokens * top_k, size), w2, down, None, None, None, weights,
                    ids, sorted_ids, expert_ids, num_post_pad, True, 1, compute_type, False,
                    False, False, None, config)
    return down.sum(dim=1)
