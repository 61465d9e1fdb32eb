"""The decode MoE kernels (workers/ops/gpu/moe_decode.py) against the torch reference, bf16.

Skips without a GPU (tests/gpu/conftest.py) or without triton.
"""
from __future__ import annotations

import pytest
import torch
from helpers.moe_cases import random_experts, rel

from tandem.workers.ops.backend import triton_available
from tandem.workers.ops.moe import select_experts, torch_fused_moe

if not triton_available():
    pytest.skip("triton is not installed", allow_module_level=True)

from tandem.workers.ops.gpu import moe_decode  # noqa: E402  (needs triton)

# (experts, top_k, hidden, intermediate): Mixtral-like, a mid shape, Qwen3-30B-A3B's experts,
# and DeepSeek-V3's expert count with a small hidden size.
SHAPES = [(8, 2, 1024, 512), (64, 8, 1024, 512), (128, 8, 2048, 768), (256, 8, 512, 256)]
TOKENS = [1, 2, 7, 16, 64]
MAX_REL = 1e-2


def make_case(num_tokens, num_experts, hidden_size, size, seed=0, dtype=torch.bfloat16):
    """Random experts and bf16 router logits [T, E] from the same generator."""
    gen, hidden, w13, w2 = random_experts(num_tokens, num_experts, hidden_size, size, seed,
                                          dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device="cuda").to(dtype)
    return hidden, w13, w2, logits


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("num_experts, top_k, hidden_size, size", SHAPES)
def test_decode_moe_matches_torch(num_tokens, num_experts, top_k, hidden_size, size):
    hidden, w13, w2, logits = make_case(num_tokens, num_experts, hidden_size, size,
                                        seed=num_tokens)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    ref = torch_fused_moe(hidden, w13, w2, weights, ids)
    given = moe_decode.decode_moe(hidden, w13, w2, topk_weights=weights, topk_ids=ids)
    routed = moe_decode.decode_moe(hidden, w13, w2, router_logits=logits, top_k=top_k)
    for out in (given, routed):
        assert out.shape == ref.shape and out.dtype == torch.bfloat16
        assert rel(out, ref) <= MAX_REL
    terms = moe_decode.decode_moe(hidden, w13, w2, router_logits=logits, top_k=top_k,
                                  terms=True)  # the sum over k left to the caller
    assert terms.shape == (num_tokens, top_k, hidden_size)
    assert rel(terms.float().sum(1).to(torch.bfloat16), routed) <= 1e-3  # summing order
    fp32_sum = moe_decode.decode_moe(hidden, w13, w2, router_logits=logits, top_k=top_k,
                                     fp32_sum=True)  # added by the down kernel's atomics
    assert fp32_sum.shape == (num_tokens, hidden_size) and fp32_sum.dtype == torch.float32
    assert rel(fp32_sum.to(torch.bfloat16), routed) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 2])
@pytest.mark.parametrize("gate_up_block_n", [16, 32, 64])
@pytest.mark.parametrize("fp32_sum", [False, True])
def test_gate_up_slab_widths(gate_up_block_n, num_tokens, fp32_sum):
    """Each gate_up width default_config picks at decode's smallest batches, on an
    intermediate size none of them divides (the last slab's columns masked)."""
    hidden, w13, w2, logits = make_case(num_tokens, 64, 512, 200, seed=gate_up_block_n)
    weights, ids = select_experts(logits, 8, renormalize=True)
    ref = torch_fused_moe(hidden, w13, w2, weights, ids)
    config = {**moe_decode.default_config(num_tokens * 8), "gate_up_block_n": gate_up_block_n}
    out = moe_decode.decode_moe(hidden, w13, w2, topk_weights=weights, topk_ids=ids,
                                config=config, fp32_sum=fp32_sum)
    assert rel(out.to(torch.bfloat16), ref) <= MAX_REL


GROUPED = dict(n_group=8, topk_group=4, routed_scaling_factor=2.5)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 33, 8192])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_experts, top_k, routing", [
    (8, 2, {}), (128, 8, {}), (60, 4, {}),
    (256, 8, dict(scoring="sigmoid", bias=True, **GROUPED)),    # DeepSeek-V3
    (160, 8, dict(scoring="sigmoid", bias=True, n_group=1)),    # GLM-4.5
    (64, 6, dict(topk_group=3, n_group=8, routed_scaling_factor=16.0))])  # DeepSeek-V2
def test_route_kernel_matches_select_experts(num_experts, top_k, routing, renormalize,
                                             num_tokens):
    gen = torch.Generator(device="cuda").manual_seed(num_experts)
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen)
    routing = dict(routing, renormalize=renormalize)
    if routing.pop("bias", False):
        routing["e_score_correction_bias"] = torch.randn(num_experts, device="cuda",
                                                         generator=gen) * 0.5
    weights, ids = moe_decode.route(logits, top_k, **routing)
    ref_weights, ref_ids = select_experts(logits, top_k, **routing)
    order, ref_order = ids.long().argsort(1), ref_ids.argsort(1)
    assert torch.equal(ids.long().gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, top_k", [(128, 8), (5, 1), (1000, 1)])
def test_many_pairs_and_top1(num_tokens, top_k):
    hidden, w13, w2, logits = make_case(num_tokens, 128, 256, 128, seed=3)
    weights, ids = select_experts(logits, top_k, renormalize=top_k > 1)
    ref = torch_fused_moe(hidden, w13, w2, weights, ids)
    out = moe_decode.decode_moe(hidden, w13, w2, topk_weights=weights, topk_ids=ids)
    assert rel(out, ref) <= MAX_REL


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, by_pair", [(48, False), (48, True), (3, None)])
def test_tokens_that_pick_the_same_experts(num_tokens, by_pair):
    """Every token on the same k experts: one program reads each expert for all tokens, on
    the expert grid and on the pair grid (where the later pairs' programs stand down); 3
    tokens take the pair grid by default (12 pairs, 16 experts)."""
    hidden, w13, w2, _ = make_case(num_tokens, 16, 256, 128)
    ids = torch.tensor([[3, 7, 11, 0]], device="cuda").expand(num_tokens, 4).contiguous()
    weights = torch.softmax(torch.randn(num_tokens, 4, device="cuda"), dim=-1)
    ref = torch_fused_moe(hidden, w13, w2, weights, ids)
    config = None if by_pair is None else {**moe_decode.default_config(num_tokens * 4),
                                           "by_pair": by_pair}
    out = moe_decode.decode_moe(hidden, w13, w2, topk_weights=weights, topk_ids=ids,
                                config=config)
    assert rel(out, ref) <= MAX_REL


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, fp32_sum", [(8, False), (1, True), (8, True)])
def test_decode_moe_replays_in_a_cuda_graph(num_tokens, fp32_sum):
    """Replays with new logits give the new result; with fp32_sum the graph's sum is zeroed by
    each replay's gate_up kernel, so replays never add onto the last one's values."""
    hidden, w13, w2, logits = make_case(num_tokens, 128, 512, 256)
    static_logits = logits.clone()
    moe_decode.decode_moe(hidden, w13, w2, router_logits=static_logits, top_k=8,
                          fp32_sum=fp32_sum)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_decode.decode_moe(hidden, w13, w2, router_logits=static_logits, top_k=8,
                                    fp32_sum=fp32_sum)
    for seed in (0, 1, 1, 2):
        static_logits.copy_(torch.randn(num_tokens, 128, device="cuda",
                                        generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        weights, ids = select_experts(static_logits, 8, renormalize=True)
        assert rel(out, torch_fused_moe(hidden, w13, w2, weights, ids)) <= MAX_REL


@pytest.mark.gpu
def test_fused_moe_module_takes_decode_path_on_aiter_backend():
    from tandem.workers.ops.aiter_compat import aiter_available
    from tandem.workers.ops.backend import KernelBackend
    from tandem.workers.ops.moe import FusedMoE
    if not aiter_available():
        pytest.skip("amd-aiter is not installed")
    E, k, H, I = 64, 8, 512, 256
    layers = [FusedMoE(E, H, I, backend=b).to("cuda", torch.bfloat16)
              for b in (KernelBackend.TORCH, KernelBackend.AITER_TRITON)]
    hidden, w13, w2, logits = make_case(4, E, H, I)
    for layer in layers:
        layer.w13.data.copy_(w13)
        layer.w2.data.copy_(w2)
    ref, out = (layer.forward_logits(hidden, logits, top_k=k, renormalize=True)
                for layer in layers)
    assert rel(out, ref) <= MAX_REL


def test_bad_arguments_are_named():
    hidden, w13, w2, logits = (torch.zeros(2, 8), torch.zeros(4, 8, 8), torch.zeros(4, 8, 4),
                               torch.zeros(2, 4))
    with pytest.raises(ValueError, match="router_logits and top_k"):
        moe_decode.decode_moe(hidden, w13, w2)
    with pytest.raises(ValueError, match="at most"):
        moe_decode.decode_moe(torch.zeros(2000, 8), w13, w2,
                              router_logits=torch.zeros(2000, 4), top_k=2)


# -- engine: tiny softmax-routed MoE models on aiter-triton, decode through CUDA graphs --------

@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_unnormed", "mixtral", "glm4_moe"])
def test_moe_engine_fp32_greedy_equals_transformers_with_graphs(moe_checkpoint, name):
    """Batches of up to 8 sequences take the decode kernels for routing and experts (fp32
    dots, no tf32), and batch 1 the fused attention GEMVs: greedy tokens equal fp32
    transformers'. Qwen3-MoE and Mixtral leave the experts' outputs for the next norm to sum;
    GLM-4.5 (sigmoid, grouped, a shared expert) sums them in its block."""
    from helpers.checkpoints import PARITY_LENGTHS, random_prompts

    from tandem import LLM, SamplingParams
    from tandem.workers.ops.aiter_compat import aiter_available
    if not aiter_available():
        pytest.skip("amd-aiter is not installed")
    ckpt = moe_checkpoint(name)
    greedy = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    prompts = [p[:30] for p in random_prompts(PARITY_LENGTHS, seed=43)]  # prefill <= 512 pairs
    llm = LLM(ckpt.path, dtype="float32", device="cuda", kernels="aiter-triton", max_num_seqs=8)
    assert llm.engine.runner.graphs is not None
    for prompt, out in zip(prompts, llm.generate(prompts, greedy)):
        assert out.token_ids == ckpt.greedy(prompt, 24)
    for prompt in prompts[:2]:  # batch 1: the attention half runs as fused GEMVs too
        assert llm.generate([prompt], greedy)[0].token_ids == ckpt.greedy(prompt, 24)
