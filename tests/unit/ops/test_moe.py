"""MoE op: routing against transformers' routers, the fused torch experts against a naive loop,
and the expert weight loader."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.workers.ops.backend import KernelBackend
from tandem.workers.ops.moe import FusedMoE, expert_targets, select_experts, torch_fused_moe


def naive_moe(hidden, w13, w2, topk_weights, topk_ids, w13_bias=None, w2_bias=None):
    """One token, one chosen expert at a time."""
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for weight, expert in zip(topk_weights[t].tolist(), topk_ids[t].tolist()):
            gate_up = w13[expert] @ hidden[t]
            if w13_bias is not None:
                gate_up = gate_up + w13_bias[expert]
            gate, up = gate_up.chunk(2)
            y = w2[expert] @ (F.silu(gate) * up)
            if w2_bias is not None:
                y = y + w2_bias[expert]
            out[t] += weight * y
    return out


def random_routing(num_tokens, num_experts, top_k, gen):
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    return select_experts(logits, top_k, renormalize=True)


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [
    (1, 4, 2), (7, 8, 2), (33, 8, 3), (64, 16, 4), (5, 1, 1), (40, 4, 4)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_torch_fused_moe_equals_naive_loop(num_tokens, num_experts, top_k, has_bias):
    gen = torch.Generator().manual_seed(num_tokens * 100 + num_experts * 10 + top_k)
    hidden_size, inter = 24, 20
    hidden = torch.randn(num_tokens, hidden_size, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden_size, generator=gen) * 0.2
    w2 = torch.randn(num_experts, hidden_size, inter, generator=gen) * 0.2
    biases = dict(w13_bias=torch.randn(num_experts, 2 * inter, generator=gen),
                  w2_bias=torch.randn(num_experts, hidden_size, generator=gen)) if has_bias else {}
    topk_weights, topk_ids = random_routing(num_tokens, num_experts, top_k, gen)
    actual = torch_fused_moe(hidden, w13, w2, topk_weights, topk_ids, **biases)
    expected = naive_moe(hidden, w13, w2, topk_weights, topk_ids, **biases)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_fused_moe_module_loads_per_expert_tensors_and_runs():
    gen = torch.Generator().manual_seed(0)
    num_experts, hidden_size, inter = 4, 16, 8
    moe = FusedMoE(num_experts, hidden_size, inter, bias=True, backend=KernelBackend.TORCH)
    assert (moe.w13.shape, moe.w2.shape) == ((4, 16, 16), (4, 16, 8))
    assert moe.w13.num_shards == 8 and moe.w2.num_shards == 4
    shapes = [(inter, hidden_size), (inter, hidden_size), (hidden_size, inter)]
    gate, up, down = (torch.randn(num_experts, *shape, generator=gen) for shape in shapes)
    gate_b, up_b, down_b = (torch.randn(num_experts, n, generator=gen)
                            for n in (inter, inter, hidden_size))
    for e in range(num_experts):
        moe.weight_loader(moe.w13, gate[e], "w1", e)
        moe.weight_loader(moe.w13, up[e], "w3", e)
        moe.weight_loader(moe.w2, down[e], "w2", e)
        moe.weight_loader(moe.w13_bias, gate_b[e], "w1", e)
        moe.weight_loader(moe.w13_bias, up_b[e], "w3", e)
        moe.weight_loader(moe.w2_bias, down_b[e], "w2", e)
    w13, w13_bias = torch.cat([gate, up], dim=1), torch.cat([gate_b, up_b], dim=1)
    assert torch.equal(moe.w13, w13) and torch.equal(moe.w2, down)
    assert torch.equal(moe.w13_bias, w13_bias) and torch.equal(moe.w2_bias, down_b)
    hidden = torch.randn(9, hidden_size, generator=gen)
    topk_weights, topk_ids = random_routing(9, num_experts, 2, gen)
    torch.testing.assert_close(moe(hidden, topk_weights, topk_ids),
                               naive_moe(hidden, w13, down, topk_weights, topk_ids, w13_bias,
                                         down_b), rtol=1e-5, atol=1e-5)


def test_fused_moe_loads_tensors_stacked_over_experts():
    gen = torch.Generator().manual_seed(1)
    moe = FusedMoE(3, 16, 8)
    gate_up, down = torch.randn(3, 16, 16, generator=gen), torch.randn(3, 16, 8, generator=gen)
    targets = expert_targets("experts", "w13", None, 3) + expert_targets("experts", "w2", None, 3)
    assert len(targets) == 9 and targets[0] == ("experts.w13", "w1", 0)
    for name, shard_id, expert_id in targets:
        param = moe.w13 if name == "experts.w13" else moe.w2
        moe.weight_loader(param, gate_up if param is moe.w13 else down, shard_id, expert_id)
    assert torch.equal(moe.w13, gate_up) and torch.equal(moe.w2, down)


@pytest.mark.parametrize("param_name,tensor_shape,shard_id,expert_id,message", [
    ("w13", (9, 16), "w1", 0, r"expert 0 shard w1: expected shape \(8, 16\)"),
    ("w2", (16, 9), "w2", 2, r"expert 2 shard w2: expected shape \(16, 8\)"),
    ("w13", (4, 16, 16), "w3", 1, r"expected 3 stacked experts"),
    ("w13", (8, 16), "w2", 0, r"shard 'w2' does not belong"),
    ("w13", (8, 16), "gate", 0, r"shard_id='gate'"),
    ("w2", (16, 8), "w2", 3, r"expert_id=3 not in \[0, 3\)"),
])
def test_fused_moe_weight_loader_rejects_bad_tensors(param_name, tensor_shape, shard_id,
                                                      expert_id, message):
    moe = FusedMoE(3, 16, 8)
    with pytest.raises(ValueError, match=message):
        moe.weight_loader(getattr(moe, param_name), torch.zeros(tensor_shape), shard_id,
                          expert_id)


def test_fused_moe_rejects_unknown_activation():
    with pytest.raises(ValueError, match="activation='gelu'"):
        FusedMoE(2, 8, 8, activation="gelu")


# ---- routing vs transformers -------------------------------------------------------------

def by_expert_id(weights, ids):
    """Rows sorted by expert id, so routers that return ids in different orders compare."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


def run_hf_router(router, num_tokens, hidden_size, seed, bias=None):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        if bias is not None:
            router.e_score_correction_bias.copy_(bias)
        logits, weights, ids = router(torch.randn(num_tokens, hidden_size, generator=gen))
    return logits, *by_expert_id(weights.float(), ids)


def assert_same_routing(actual, expected_weights, expected_ids):
    weights, ids = by_expert_id(*actual)
    assert actual[0].dtype == torch.float32
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_softmax_routing_matches_qwen3_moe(norm_topk_prob):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4,
                            norm_topk_prob=norm_topk_prob)
    logits, weights, ids = run_hf_router(Qwen3MoeTopKRouter(config), 50, 32, seed=3)
    assert_same_routing(select_experts(logits, 4, renormalize=norm_topk_prob), weights, ids)


def test_softmax_routing_matches_mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    config = MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2)
    logits, weights, ids = run_hf_router(MixtralTopKRouter(config), 50, 32, seed=4)
    assert_same_routing(select_experts(logits, 2, renormalize=True), weights, ids)


def test_grouped_softmax_routing_matches_deepseek_v2():
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4,
                              n_group=4, topk_group=2, routed_scaling_factor=2.5,
                              topk_method="group_limited_greedy")
    logits, weights, ids = run_hf_router(DeepseekV2TopkRouter(config), 50, 32, seed=5)
    assert_same_routing(select_experts(logits, 4, renormalize=False, n_group=4, topk_group=2,
                                       routed_scaling_factor=2.5), weights, ids)


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("n_group,topk_group", [(4, 2), (1, 1)])
def test_sigmoid_grouped_routing_matches_transformers(family, norm_topk_prob, n_group,
                                                      topk_group):
    import transformers

    if family == "glm4_moe":
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter as Router
        config_cls = transformers.Glm4MoeConfig
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3TopkRouter as Router)
        config_cls = transformers.DeepseekV3Config
    config = config_cls(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4,
                        n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5,
                        norm_topk_prob=norm_topk_prob)
    # A correction bias large enough to change which experts are chosen.
    bias = torch.randn(16, generator=torch.Generator().manual_seed(6)) * 0.5
    logits, weights, ids = run_hf_router(Router(config), 50, 32, seed=7, bias=bias)
    actual = select_experts(logits, 4, scoring="sigmoid", renormalize=norm_topk_prob,
                            e_score_correction_bias=bias, n_group=n_group,
                            topk_group=topk_group, routed_scaling_factor=2.5)
    assert_same_routing(actual, weights, ids)
    unbiased = select_experts(logits, 4, scoring="sigmoid", renormalize=norm_topk_prob,
                              n_group=n_group, topk_group=topk_group)
    assert not torch.equal(by_expert_id(*unbiased)[1], ids)  # the bias mattered


def test_select_experts_rejects_bad_arguments():
    with pytest.raises(ValueError, match="scoring='relu'"):
        select_experts(torch.zeros(2, 4), 2, scoring="relu", renormalize=True)
    with pytest.raises(ValueError, match="n_group=3"):
        select_experts(torch.zeros(2, 8), 2, scoring="sigmoid", renormalize=True, n_group=3,
                       topk_group=1)
