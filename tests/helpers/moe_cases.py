"""Random MoE layers for the GPU kernel tests: expert weights scaled so outputs stay O(1), and
softmax top-k routing of random logits, all from one seeded generator."""
from __future__ import annotations

import torch

from tandem.workers.ops.moe import select_experts


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error in the 2-norm."""
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def random_experts(num_tokens, num_experts, hidden_size, size, seed=0, dtype=torch.bfloat16,
                   device="cuda"):
    """(generator, hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]); the generator continues for
    whatever the caller draws next (router logits)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)
    hidden = randn(num_tokens, hidden_size)
    w13 = randn(num_experts, 2 * size, hidden_size, scale=hidden_size ** -0.5)
    w2 = randn(num_experts, hidden_size, size, scale=size ** -0.5)
    return gen, hidden, w13, w2


def routed_case(num_tokens, num_experts, top_k, hidden_size, size, seed=0,
                dtype=torch.bfloat16, device="cuda", renormalize=True):
    """(hidden, w13, w2, topk_weights, topk_ids): random experts and fp32 router logits routed
    by select_experts."""
    gen, hidden, w13, w2 = random_experts(num_tokens, num_experts, hidden_size, size, seed,
                                          dtype, device)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=device)
    weights, ids = select_experts(logits, top_k, renormalize=renormalize)
    return hidden, w13, w2, weights, ids
