"""Attention sinks, sliding windows, YaRN and partial/interleaved RoPE against independent
references: a dense definition of attention, and transformers' GPT-OSS, DeepSeek-V3, GLM-4(-MoE)
and Llama modules."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.paged import scattered_batch
from torch import nn

import tandem.workers.ops.attention as attention_mod
from tandem.workers.ops.attention import Attention
from tandem.workers.ops.rotary import RotaryEmbedding, rope_parameters, yarn_softmax_scale

HEADS, KV_HEADS, DIM, BLOCK, NUM_BLOCKS = 4, 2, 16, 4, 40
SCALE = DIM ** -0.5
# (tokens already cached, new tokens this step): a fresh prefill, a chunk continuing earlier
# context, and decodes at positions 12, 3 and 17 (beyond the small windows).
LAYOUT = [(0, 9), (6, 5), (12, 1), (3, 1), (17, 1)]


def _mixed_batch(attn: Attention, seed: int = 0):
    """Fill attn's cache with each sequence's context (blocks scattered through the cache) and
    return (full per-sequence q/k/v, this step's flat q/k/v, metadata)."""
    gen = torch.Generator().manual_seed(seed)
    attn.bind_kv_cache(torch.zeros(NUM_BLOCKS, BLOCK, KV_HEADS, DIM),
                       torch.zeros(NUM_BLOCKS, BLOCK, KV_HEADS, DIM))
    tables, meta = scattered_batch(LAYOUT, NUM_BLOCKS, BLOCK, gen)
    full = []
    for (cached, new), table in zip(LAYOUT, tables):
        total = cached + new
        q, k, v = (torch.randn(total, h, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
        for pos in range(cached):
            attn.k_cache[table[pos // BLOCK], pos % BLOCK] = k[pos]
            attn.v_cache[table[pos // BLOCK], pos % BLOCK] = v[pos]
        full.append((q, k, v))
    step = [torch.cat([f[j][c:] for (c, _), f in zip(LAYOUT, full)]) for j in range(3)]
    return full, step, meta


def _dense_reference(q, k, v, first_query_pos, sliding_window, sinks):
    """Attention from its definition, in float64: query at p sees keys j with p - W < j <= p;
    the sink adds exp(sink_h) to the denominator only."""
    group = q.shape[1] // k.shape[1]
    q = q.double()
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        p = first_query_pos + i
        lo = 0 if sliding_window is None else max(0, p - sliding_window + 1)
        logits = torch.einsum("hd,jhd->hj", q[i], k[lo:p + 1]) * SCALE  # [H, visible]
        weights = logits.exp()
        denominator = weights.sum(-1, keepdim=True)
        if sinks is not None:
            denominator = denominator + sinks.double().exp()[:, None]
        out[i] = torch.einsum("hj,jhd->hd", weights / denominator, v[lo:p + 1])
    return out.float()


@pytest.mark.parametrize("sliding_window,has_sinks", [
    (None, True), (1, False), (4, False), (4, True), (7, True), (64, False), (64, True)])
def test_paged_attention_variants_match_dense_definition(sliding_window, has_sinks):
    attn = Attention(HEADS, DIM, SCALE, KV_HEADS, sliding_window=sliding_window,
                     has_sinks=has_sinks)
    if has_sinks:
        attn.sinks.data.copy_(torch.tensor([-1.0, 0.5, 2.0, 4.0]))
    full, (q, k, v), meta = _mixed_batch(attn)
    out = attn(q, k, v, meta)
    starts = meta.query_start_loc_host
    for i, ((cached, _), (fq, fk, fv)) in enumerate(zip(LAYOUT, full)):
        ref = _dense_reference(fq[cached:], fk, fv, cached, sliding_window, attn.sinks)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", [[(0, 9), (0, 5)], [(0, 11)]])
@pytest.mark.parametrize("kv_heads", [KV_HEADS, HEADS])
@pytest.mark.parametrize("sliding_window", [None, 4])
@pytest.mark.parametrize("gqa_in_kernel", [False, True])
def test_fresh_prefill_sdpa_matches_dense_definition(layout, kv_heads, sliding_window,
                                                     gqa_in_kernel):
    """The GPU backend's fresh-prefill path (torch SDPA per sequence, K/V heads repeated to the
    query heads or read as they are with enable_gqa), run here on CPU tensors: GQA and plain
    heads, several sequences and a lone one (whose output is returned without a copy), with
    and without a window."""
    attention_gpu = pytest.importorskip("tandem.workers.ops.attention_gpu")
    gen = torch.Generator().manual_seed(len(layout) + kv_heads)
    _, meta = scattered_batch(layout, NUM_BLOCKS, BLOCK, gen)
    tokens = sum(n for _, n in layout)
    q = torch.randn(tokens, HEADS, DIM, generator=gen)
    k, v = (torch.randn(tokens, kv_heads, DIM, generator=gen) for _ in range(2))
    out = attention_gpu._fresh_prefill_sdpa(q, k, v, meta, SCALE, sliding_window,
                                        gqa_in_kernel)
    assert out.shape == q.shape and out.is_contiguous()
    starts = meta.query_start_loc_host
    for i in range(len(layout)):
        span = slice(starts[i], starts[i + 1])
        ref = _dense_reference(q[span], k[span], v[span], 0, sliding_window, None)
        torch.testing.assert_close(out[span], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sliding_window", [None, 3, 6])
def test_sinks_and_window_match_transformers_gpt_oss_eager(sliding_window):
    """The same batch through GPT-OSS's eager attention, masked by transformers' own causal /
    sliding-window mask functions (so their window boundary is the one checked)."""
    from transformers.masking_utils import (causal_mask_function,
                                            sliding_window_causal_mask_function)
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    attn = Attention(HEADS, DIM, SCALE, KV_HEADS, sliding_window=sliding_window, has_sinks=True)
    attn.sinks.data.copy_(torch.tensor([0.3, -2.0, 1.5, 3.0]))
    full, (q, k, v), meta = _mixed_batch(attn, seed=1)
    out = attn(q, k, v, meta)
    hf_module = nn.Module().eval()
    hf_module.sinks = nn.Parameter(attn.sinks.detach().clone())
    hf_module.num_key_value_groups = HEADS // KV_HEADS
    mask_fn = (causal_mask_function if sliding_window is None
               else sliding_window_causal_mask_function(sliding_window))
    starts = meta.query_start_loc_host
    for i, ((cached, _), (fq, fk, fv)) in enumerate(zip(LAYOUT, full)):
        total = fk.shape[0]
        zero = torch.tensor(0)
        allowed = mask_fn(zero, zero, torch.arange(cached, total)[:, None],
                          torch.arange(total)[None, :])
        additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
        ref, _ = eager_attention_forward(
            hf_module, fq[cached:].transpose(0, 1)[None], fk.transpose(0, 1)[None],
            fv.transpose(0, 1)[None], additive[None, None], scaling=SCALE)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], ref[0], rtol=1e-5, atol=1e-5)


def test_attention_variant_api_and_sink_loading(monkeypatch):
    plain = Attention(HEADS, DIM, SCALE, KV_HEADS)
    assert plain.sinks is None and not list(plain.parameters())
    assert plain.window_size == (-1, -1)
    assert Attention(HEADS, DIM, SCALE, KV_HEADS, sliding_window=128).window_size == (127, 0)
    with pytest.raises(ValueError, match="sliding_window=0"):
        Attention(HEADS, DIM, SCALE, KV_HEADS, sliding_window=0)

    attn = Attention(HEADS, DIM, SCALE, KV_HEADS, has_sinks=True)
    assert dict(attn.named_parameters()).keys() == {"sinks"}
    assert attn.sinks.dtype == torch.float32
    full = torch.arange(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="sinks"):
        attn.sinks.weight_loader(attn.sinks, full)  # 8 heads, but TP size 1 holds 4
    attn.sinks.weight_loader(attn.sinks, full[:4])
    torch.testing.assert_close(attn.sinks.data, torch.arange(4.0))
    monkeypatch.setattr(attention_mod, "tp_rank_and_size", lambda: (1, 2))
    attn.sinks.weight_loader(attn.sinks, full)  # rank 1 of 2 takes heads 4..7
    torch.testing.assert_close(attn.sinks.data, torch.arange(4.0, 8.0))


def _hf_rotate(apply_fn, rotary, q, k, positions):
    """q [T, H, D], k [T, KVH, D] through a transformers rotary module and apply function."""
    cos, sin = rotary(q, positions[None])
    q_ref, k_ref = apply_fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return cos[0], sin[0], q_ref[0].transpose(0, 1), k_ref[0].transpose(0, 1)


def _deinterleave(x: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    rot = x[..., :rotary_dim]
    return torch.cat((rot[..., 0::2], rot[..., 1::2], x[..., rotary_dim:]), dim=-1)


def test_yarn_matches_transformers_gpt_oss_default_config():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import (GptOssRotaryEmbedding,
                                                              apply_rotary_pos_emb)

    config = GptOssConfig(num_hidden_layers=2, hidden_size=64, head_dim=64,
                          num_attention_heads=4, num_key_value_heads=2)
    params = rope_parameters(config)
    assert params["rope_type"] == "yarn" and params["truncate"] is False
    ours = RotaryEmbedding(64, config.max_position_embeddings, params)
    positions = torch.tensor([0, 1, 100, 4095, 4096, 50000, 131071])
    q, k = torch.randn(7, 4, 64), torch.randn(7, 2, 64)
    cos, sin, q_ref, k_ref = _hf_rotate(apply_rotary_pos_emb, GptOssRotaryEmbedding(config),
                                        q, k, positions)
    assert ours.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(32.0)).item() + 1)
    torch.testing.assert_close(ours.cos[positions], cos, rtol=0, atol=1e-6)  # emb = freqs
    torch.testing.assert_close(ours.sin[positions], sin, rtol=0, atol=1e-6)
    q_out, k_out = ours(positions, q, k)
    torch.testing.assert_close(q_out, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, k_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mscale,mscale_all_dim", [(1.0, 1.0), (0.707, 1.0)])
def test_yarn_matches_transformers_deepseek_v3_interleaved(mscale, mscale_all_dim):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3RotaryEmbedding, apply_rotary_pos_emb_interleave, yarn_apply_mscale)

    config = DeepseekV3Config(
        num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
        qk_rope_head_dim=64, qk_nope_head_dim=128, max_position_embeddings=163840,
        rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                      "mscale": mscale, "mscale_all_dim": mscale_all_dim,
                      "original_max_position_embeddings": 4096})
    params = rope_parameters(config)
    ours = RotaryEmbedding(64, config.max_position_embeddings, params, is_neox_style=False)
    positions = torch.tensor([0, 7, 4095, 4096, 100000, 163839])
    q, k = torch.randn(6, 4, 64), torch.randn(6, 1, 64)
    cos, sin, q_ref, k_ref = _hf_rotate(apply_rotary_pos_emb_interleave,
                                        DeepseekV3RotaryEmbedding(config), q, k, positions)
    torch.testing.assert_close(ours.cos[positions], cos[:, :32], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.sin[positions], sin[:, :32], rtol=0, atol=1e-6)
    q_out, k_out = ours(positions, q, k)
    # transformers returns the rotated pairs de-interleaved; ours keeps them in place.
    torch.testing.assert_close(_deinterleave(q_out, 64), q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_deinterleave(k_out, 64), k_ref, rtol=1e-5, atol=1e-5)
    assert yarn_softmax_scale(params, 192) == pytest.approx(
        yarn_apply_mscale(config.rope_parameters, 192 ** -0.5), rel=1e-12)


@pytest.mark.parametrize("extra", [{}, {"attention_factor": 0.8, "beta_fast": 16.0,
                                        "beta_slow": 2.0, "truncate": False}])
def test_yarn_matches_transformers_llama_style(extra):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (LlamaRotaryEmbedding,
                                                          apply_rotary_pos_emb)

    rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
            "original_max_position_embeddings": 128, **extra}
    config = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=512,
                         rope_parameters=rope)
    ours = RotaryEmbedding(32, 512, rope_parameters(config))
    positions = torch.tensor([0, 3, 127, 128, 300, 511])
    q, k = torch.randn(6, 2, 32), torch.randn(6, 1, 32)
    _, _, q_ref, k_ref = _hf_rotate(apply_rotary_pos_emb, LlamaRotaryEmbedding(config),
                                    q, k, positions)
    q_out, k_out = ours(positions, q, k)
    torch.testing.assert_close(q_out, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, k_ref, rtol=1e-5, atol=1e-5)


def test_partial_rotary_matches_transformers_glm4_moe():
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import (Glm4MoeRotaryEmbedding,
                                                                apply_rotary_pos_emb)

    config = Glm4MoeConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=128)
    ours = RotaryEmbedding(128, 4096, rope_parameters(config))
    assert ours.rotary_dim == 64 and ours.is_neox_style  # partial_rotary_factor 0.5, halves
    positions = torch.tensor([0, 1, 17, 1000, 4095])
    q, k = torch.randn(5, 4, 128), torch.randn(5, 2, 128)
    cos, sin, q_ref, k_ref = _hf_rotate(apply_rotary_pos_emb, Glm4MoeRotaryEmbedding(config),
                                        q, k, positions)
    torch.testing.assert_close(ours.cos[positions], cos[:, :32], rtol=0, atol=1e-6)
    q_out, k_out = ours(positions, q, k)
    torch.testing.assert_close(q_out, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, k_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q_out[..., 64:], q[..., 64:], rtol=0, atol=0)  # pass-through


def test_partial_interleaved_rotary_matches_transformers_glm4_dense():
    from transformers import Glm4Config
    from transformers.models.glm4.modeling_glm4 import Glm4RotaryEmbedding, apply_rotary_pos_emb

    config = Glm4Config(num_hidden_layers=1, hidden_size=64, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.5)
    ours = RotaryEmbedding(32, 2048, rope_parameters(config), is_neox_style=False)
    assert ours.rotary_dim == 16
    positions = torch.tensor([0, 2, 99, 2047])
    q, k = torch.randn(4, 2, 32), torch.randn(4, 1, 32)
    _, _, q_ref, k_ref = _hf_rotate(apply_rotary_pos_emb, Glm4RotaryEmbedding(config),
                                    q, k, positions)
    q_out, k_out = ours(positions, q, k)
    torch.testing.assert_close(q_out, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, k_ref, rtol=1e-5, atol=1e-5)


def test_rope_parameters_fill_yarn_defaults_like_transformers():
    from transformers import LlamaConfig

    legacy = SimpleNamespace(rope_theta=5e5, max_position_embeddings=256,
                             rope_scaling={"type": "yarn", "factor": 4.0},
                             partial_rotary_factor=0.25)
    params = rope_parameters(legacy)
    hf = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=256,
                     rope_theta=5e5, rope_scaling={"type": "yarn", "factor": 4.0}).rope_parameters
    assert params["original_max_position_embeddings"] == hf["original_max_position_embeddings"]
    assert params["partial_rotary_factor"] == 0.25
    assert RotaryEmbedding(64, 256, params).rotary_dim == 16
    with pytest.raises(ValueError, match="rope_type='dynamic'"):
        RotaryEmbedding(32, 64, {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError, match="rotary_dim=7"):
        RotaryEmbedding(32, 64, {"rope_type": "default", "rope_theta": 1e4}, rotary_dim=7)
