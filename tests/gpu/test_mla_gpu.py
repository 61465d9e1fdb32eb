"""MLA (DeepSeek-V2/V3 attention) on the aiter-triton backend against the torch reference.

Kernel: our split-KV MLA decode over the paged latent cache, several head counts (16 = V3 at
TP 8, 128 = V3 whole), block sizes, split counts and contexts crossing blocks; the latent write
skips padding slots. Module: MLAAttention(aiter-triton) against MLAAttention(torch) on decode,
fresh-prefill and mixed (cached context + decodes) batches, and decode replayed in a CUDA graph
at new lengths. Caches are NaN outside the rows a case writes, so a misread row fails. bf16
results are held against the reference in fp32 on the same (bf16-rounded) inputs.
Engine: tiny DeepSeek-V3 checkpoints, fp32, decode through CUDA graphs, against transformers.
"""
from __future__ import annotations

import pytest
import torch
from helpers.checkpoints import PARITY_LENGTHS, build_checkpoint, random_prompts
from helpers.gpu_paged import paged_metadata
from helpers.mla_checkpoints import MLA_BASE, MLA_VARIANTS

from tandem.workers.ops.aiter_compat import aiter_available

pytest.importorskip("triton", reason="the aiter-triton backend needs triton")
if not aiter_available() or not torch.cuda.is_available():
    pytest.skip("needs a GPU and amd-aiter (pip install amd-aiter)", allow_module_level=True)

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.workers.ops.attention import gather_kv  # noqa: E402
from tandem.workers.ops.backend import KernelBackend  # noqa: E402
from tandem.workers.ops.gpu.mla_decode import (  # noqa: E402
    mla_decode_attention, mla_num_splits, write_latent_cache)
from tandem.workers.ops.mla import MLAAttention  # noqa: E402

DEV = "cuda"
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
V3_DIMS = dict(nope=128, rope=64, v=128, rank=512)  # DeepSeek-V3's head dims
TINY_DIMS = dict(nope=16, rope=8, v=24, rank=32)  # the tiny checkpoints' (P < 16, R < 64)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def mla_case(layout, heads, dims, block_size, dtype, seed):
    """layout [(cached, new)] per sequence. Returns a NaN-poisoned latent cache holding the
    cached rows (blocks shuffled), this step's inputs, a kv_b weight and the metadata."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    rank, rope = dims["rank"], dims["rope"]
    lens = [c + n for c, n in layout]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    cache = torch.full((num_blocks, block_size, 1, rank + rope), float("nan"), dtype=dtype,
                       device=DEV)
    order = torch.randperm(num_blocks, generator=gen, device=DEV).tolist()
    tables, slots, starts = [], [], [0]
    for (cached, new), total in zip(layout, lens):
        nb = -(-total // block_size)
        table, order = order[:nb], order[nb:]
        tables.append(table)
        for pos in range(total):
            slot = table[pos // block_size] * block_size + pos % block_size
            if pos < cached:
                cache.view(-1, rank + rope)[slot] = torch.randn(
                    rank + rope, generator=gen, device=DEV).to(dtype)
            else:
                slots.append(slot)
        starts.append(starts[-1] + new)
    tokens = starts[-1]

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)

    step = dict(q_nope=randn(tokens, heads, dims["nope"]), q_pe=randn(tokens, heads, rope),
                kv_c=randn(tokens, rank), k_pe=randn(tokens, rope))
    weight = randn(heads * (dims["nope"] + dims["v"]), rank, scale=rank ** -0.5)
    meta = paged_metadata(slots, starts, lens, tables, max(n for _, n in layout))
    return cache, step, weight, meta


def mla_op(backend, heads, dims, cache):
    op = MLAAttention(heads, dims["nope"], dims["rope"], dims["v"], dims["rank"],
                      (dims["nope"] + dims["rope"]) ** -0.5, backend)
    op.bind_kv_cache(cache)
    return op


def run_both(layout, heads, dims, block_size, dtype, seed=0):
    """(aiter-triton output, fp32 torch reference output, both ops) on one case."""
    cache, step, weight, meta = mla_case(layout, heads, dims, block_size, dtype, seed)
    ours = mla_op(KernelBackend.AITER_TRITON, heads, dims, cache.clone())
    ref = mla_op(KernelBackend.TORCH, heads, dims, cache.float())
    args = [step[k] for k in ("q_nope", "q_pe", "kv_c", "k_pe")] + [weight]
    out = ours(*args, meta)
    expected = ref(*[a.float() for a in args], meta)
    return out, expected, ours, ref


DECODE = [(0, 1), (16, 1), (300, 1), (4095, 1), (1, 1)]  # 1-token prompt; block boundaries
FRESH_PREFILL = [(0, 40), (0, 77), (0, 1)]
MIXED = [(0, 40), (48, 100), (5, 7), (300, 1), (16, 1)]  # cached context + decodes


@DTYPES
@pytest.mark.parametrize("heads, dims, block_size", [
    (16, V3_DIMS, 16), (128, V3_DIMS, 64), (16, V3_DIMS, 1), (4, TINY_DIMS, 16)],
    ids=["h16-bs16", "h128-bs64", "h16-bs1", "tiny-h4-bs16"])
@pytest.mark.parametrize("layout", [DECODE, FRESH_PREFILL, MIXED], ids=["decode", "fresh",
                                                                      "mixed"])
def test_mla_module_matches_reference(layout, heads, dims, block_size, dtype):
    out, expected, ours, ref = run_both(layout, heads, dims, block_size, dtype,
                                        seed=heads + block_size)
    assert out.shape == expected.shape == (sum(n for _, n in layout), heads, dims["v"])
    assert out.dtype == dtype
    assert rel(out, expected) <= TOL[dtype]
    # the latent write landed in the same slots, bit for bit
    assert torch.equal(ours.latent_cache.float().nan_to_num(7.0),
                       ref.latent_cache.nan_to_num(7.0))


def _decode_reference(q_lat, q_pe, cache, meta, scale):
    """out [B, H, R] in fp64: softmax over the whole latent rows, values their first R."""
    rank = q_lat.shape[-1]
    outs = []
    for i, seq_len in enumerate(meta.seq_lens_host):
        rows = gather_kv(cache, meta.block_tables[i], seq_len)[:, 0].double()  # [S, R + P]
        q = torch.cat((q_lat[i], q_pe[i]), dim=-1).double()  # [H, R + P]
        outs.append(torch.softmax(q @ rows.T * scale, dim=-1) @ rows[:, :rank])
    return torch.stack(outs)


@pytest.mark.parametrize("num_splits", [1, 2, 8, 64])
@DTYPES
def test_decode_kernel_split_counts_agree(num_splits, dtype):
    layout = [(4, 1), (700, 1), (2048, 1), (0, 1)]
    cache, step, _, meta = mla_case(layout, 128, V3_DIMS, 16, dtype, seed=num_splits)
    write_latent_cache(step["kv_c"], step["k_pe"], cache, meta.slot_mapping)
    gen = torch.Generator(device=DEV).manual_seed(7)
    q_lat = torch.randn(4, 128, 512, generator=gen, device=DEV).to(dtype)
    scale = 192 ** -0.5
    out = mla_decode_attention(q_lat, step["q_pe"], cache, meta.block_tables, meta.seq_lens,
                               scale, num_splits=num_splits)
    assert rel(out, _decode_reference(q_lat, step["q_pe"], cache, meta, scale)) <= TOL[dtype]


def test_padding_rows_write_nothing_and_stay_finite():
    """CUDA-graph padding rows: slot -1, seq_len 1, block-table row of zeros."""
    cache = torch.randn(4, 16, 1, 576, device=DEV, dtype=torch.bfloat16)
    before = cache.clone()
    write_latent_cache(torch.randn(3, 512, device=DEV), torch.randn(3, 64, device=DEV), cache,
                       torch.full((3,), -1, dtype=torch.int64, device=DEV))
    assert torch.equal(cache, before)
    q_lat = torch.randn(2, 16, 512, device=DEV, dtype=torch.bfloat16)
    q_pe = torch.randn(2, 16, 64, device=DEV, dtype=torch.bfloat16)
    tables = torch.tensor([[3, 1], [0, 0]], dtype=torch.int32, device=DEV)
    seq_lens = torch.tensor([20, 1], dtype=torch.int32, device=DEV)
    out = mla_decode_attention(q_lat, q_pe, cache, tables, seq_lens, 0.1, num_splits=4)
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], cache[0, 0, 0, :512].expand(16, 512))  # one key: its value


def test_split_count_choice():
    assert mla_num_splits(1, 128, 4096, 132) == 32  # 8 head blocks x 32 splits ~ 2 waves
    assert mla_num_splits(1, 16, 4096, 132) == 64  # one head block (TP 8): capped at 64
    assert mla_num_splits(64, 128, 4096, 132) == 1
    assert mla_num_splits(1, 16, 32, 132) == 1  # never a split shorter than a 32-row tile
    assert mla_num_splits(1, 16, 40, 132) == 2


@DTYPES
def test_decode_replays_in_a_cuda_graph_at_new_lengths(dtype):
    """Captured with max_seq_len = 4096 on one batch, replayed on another batch's lengths,
    block tables and slots (copied into the same buffers): equals an eager reference."""
    replay_at_new_lengths(dtype)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@DTYPES
def test_decode_replays_in_a_cuda_graph_with_cuda1_current(dtype):
    """The same with cuda:1 as the current device (as a TP rank on cuda:1 runs), after
    captures on cuda:0 in this process: nothing in the op assumes device 0."""
    with torch.cuda.device(1):
        replay_at_new_lengths(dtype)


def replay_at_new_lengths(dtype):
    heads, dims = 16, V3_DIMS
    first = mla_case([(10, 1), (200, 1)], heads, dims, 16, dtype, seed=1)
    second = mla_case([(1000, 1), (0, 1)], heads, dims, 16, dtype, seed=2)
    cache = torch.full((first[0].shape[0] + second[0].shape[0],) + first[0].shape[1:],
                       float("nan"), dtype=dtype, device=DEV)
    op = mla_op(KernelBackend.AITER_TRITON, heads, dims, cache)
    cache[:first[0].shape[0]] = first[0]
    static_inputs = {k: v.clone() for k, v in first[1].items()}
    meta = first[3]
    meta.max_seq_len = 4096
    meta.block_tables = torch.zeros(2, 4096 // 16, dtype=torch.int32, device=DEV)
    meta.block_tables[:, :first[3].block_tables.shape[1]] = first[3].block_tables
    args = lambda: [static_inputs[k] for k in ("q_nope", "q_pe", "kv_c", "k_pe")]  # noqa: E731
    op(*args(), first[2], meta)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    # A capture stream of the current device, as the engine's (torch.cuda.graph's default is
    # one stream per process, made on whichever device was current at the first capture).
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        out = op(*args(), first[2], meta)
    # the second batch's blocks live after the first's in the shared cache
    offset = first[0].shape[0]
    cache[offset:] = second[0]
    new_tables = second[3].block_tables + offset
    meta.block_tables.zero_()
    meta.block_tables[:, :new_tables.shape[1]] = new_tables
    meta.seq_lens.copy_(second[3].seq_lens)
    meta.slot_mapping.copy_(second[3].slot_mapping + offset * 16)
    for k, v in second[1].items():
        static_inputs[k].copy_(v)
    first[2].copy_(second[2])
    graph.replay()
    second_meta = second[3]
    second_meta.block_tables = new_tables
    second_meta.slot_mapping = meta.slot_mapping.clone()
    ref = mla_op(KernelBackend.TORCH, heads, dims, cache.float().clone())
    expected = ref(*[static_inputs[k].float() for k in ("q_nope", "q_pe", "kv_c", "k_pe")],
                   first[2].float(), second_meta)
    assert rel(out, expected) <= TOL[dtype]


# -- engine: tiny DeepSeek-V3 on the aiter-triton backend, decode through CUDA graphs ---------

GREEDY = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
# MLA and dense MLPs only: AITER's fused_moe rounds fp32 dots to tf32, so exact greedy parity
# with transformers is asked of this one; the MoE variant below is held to decided steps.
DENSE_V3 = {"deepseek_v3_dense": ("deepseek_v3", {**MLA_VARIANTS["deepseek_v3"][1],
                                                  "first_k_dense_replace": 3}, {})}


def test_deepseek_v3_fp32_greedy_equals_transformers_with_graphs(tmp_path):
    ckpt = build_checkpoint("deepseek_v3_dense", tmp_path, DENSE_V3, MLA_BASE)
    prompts = random_prompts(PARITY_LENGTHS, seed=41)
    llm = LLM(ckpt.path, dtype="float32", device="cuda", kernels="aiter-triton",
              max_num_seqs=8, block_size=16)
    assert llm.engine.runner.graphs is not None
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        assert out.token_ids == ckpt.greedy(prompt, 32)
    for prompt in prompts[:3]:  # batch 1 alone (padding rows never leak into real ones)
        assert llm.generate([prompt], GREEDY)[0].token_ids == ckpt.greedy(prompt, 32)


def test_deepseek_v3_moe_fp32_follows_transformers_with_graphs(moe_checkpoint):
    """The MoE model (tf32 expert dots): every token where fp32 transformers' top-1 leads its
    top-2 by more than 0.01 logits, given our own prefix, is that top-1."""
    ckpt = moe_checkpoint("deepseek_v3")
    prompts = random_prompts(PARITY_LENGTHS, seed=42)
    llm = LLM(ckpt.path, dtype="float32", device="cuda", kernels="aiter-triton", max_num_seqs=8)
    assert llm.engine.runner.graphs is not None
    decided = 0
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        logits = ckpt.logits(prompt + out.token_ids)[len(prompt) - 1:-1]  # [32, V]
        for step, token in enumerate(out.token_ids):
            top = logits[step].topk(2)
            if top.values[0] - top.values[1] > 0.01:
                assert token == top.indices[0].item(), f"step {step} of a {len(prompt)}-prompt"
                decided += 1
    assert decided >= len(prompts) * 24  # the check was not vacuous
