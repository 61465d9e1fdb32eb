"""The prefill MoE kernels (workers/ops/gpu/moe_prefill.py) against the torch references.

The align against moe_aiter.align_by_expert (equal outputs), the whole layer against
moe.torch_fused_moe (bf16, and fp32 to rounding). Skips without a GPU (tests/gpu/conftest.py)
or without triton.
"""
from __future__ import annotations

import pytest
import torch
from helpers.moe_cases import rel, routed_case

from tandem.workers.ops.backend import triton_available
from tandem.workers.ops.moe import select_experts, torch_fused_moe
from tandem.workers.ops.moe_aiter import align_by_expert as torch_align_by_expert

if not triton_available():
    pytest.skip("triton is not installed", allow_module_level=True)

from tandem.workers.ops.gpu import moe_prefill  # noqa: E402  (needs triton)
from tandem.workers.ops.gpu.moe_prefill import GemmConfig, PrefillConfig  # noqa: E402

MAX_REL = 1e-2
# (experts, top_k, hidden, intermediate): Mixtral-like, a mid shape, Qwen3-30B-A3B's experts,
# DeepSeek-V3's expert count with a small hidden size, and sizes that no tile divides.
SHAPES = [(8, 2, 1024, 512), (64, 8, 1024, 512), (128, 8, 2048, 768), (256, 8, 512, 256),
          (60, 4, 200, 120)]
TOKENS = [1, 33, 129, 1000, 2048]


def make_case(num_tokens, num_experts, top_k, hidden_size, size, seed=0, dtype=torch.bfloat16):
    return routed_case(num_tokens, num_experts, top_k, hidden_size, size, seed, dtype,
                       renormalize=top_k > 1)


def assert_align_equal(ids, num_experts, block_m):
    out = moe_prefill.align_by_expert(ids, num_experts, block_m)
    ref = torch_align_by_expert(ids, num_experts, block_m)
    for name, got, want in zip(("sorted_ids", "expert_ids", "num_post_pad"), out, ref):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got, want), name


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [16, 64, 128])
@pytest.mark.parametrize("num_tokens", [1, 7, 129, 2048, 8192])
@pytest.mark.parametrize("num_experts, top_k", [(8, 2), (60, 4), (128, 8), (256, 8), (128, 1)])
def test_align_equals_the_torch_align(num_experts, top_k, num_tokens, block_m):
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device="cuda")
    _, ids = select_experts(logits, top_k, renormalize=False)
    assert_align_equal(ids, num_experts, block_m)
    assert_align_equal(ids.to(torch.int32), num_experts, block_m)


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [16, 128])
def test_align_with_one_expert_for_all_and_experts_nobody_picks(block_m):
    assert_align_equal(torch.full((3000, 1), 5, device="cuda"), 128, block_m)
    ids = torch.tensor([[3, 7, 11, 0]], device="cuda").expand(777, 4)
    assert_align_equal(ids, 16, block_m)
    assert_align_equal(torch.tensor([[127]], device="cuda"), 128, block_m)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("num_experts, top_k, hidden_size, size", SHAPES)
def test_prefill_moe_matches_torch(num_tokens, num_experts, top_k, hidden_size, size):
    case = make_case(num_tokens, num_experts, top_k, hidden_size, size, seed=num_tokens)
    ref = torch_fused_moe(*case)
    out = moe_prefill.prefill_fused_moe(*case)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert rel(out, ref) <= MAX_REL
    terms = moe_prefill.prefill_fused_moe(*case, terms=True)  # the sum left to the caller
    assert terms.shape == (num_tokens, top_k, hidden_size)
    assert torch.equal(terms.sum(dim=1) if top_k > 1 else terms[:, 0], out)


@pytest.mark.gpu
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("num_tokens", [130, 1000])
def test_each_top_k(num_tokens, top_k):
    case = make_case(num_tokens, 32, top_k, 256, 128, seed=top_k)
    assert rel(moe_prefill.prefill_fused_moe(*case), torch_fused_moe(*case)) <= MAX_REL


@pytest.mark.gpu
def test_fp32_matches_to_rounding():
    case = make_case(300, 16, 2, 256, 192, dtype=torch.float32)
    assert rel(moe_prefill.prefill_fused_moe(*case), torch_fused_moe(*case)) <= 1e-5


# Tiles of the probe's sweep (bench/probes/moe_prefill.py), and tiles that divide neither H
# nor I.
CONFIGS = [PrefillConfig(m, GemmConfig(n, 64, w, s), GemmConfig(128, 64, 8, 4))
           for m, n, w, s in ((64, 64, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3),
                              (128, 64, 4, 4), (64, 128, 8, 3))]
CONFIGS += [PrefillConfig(16, GemmConfig(32, 128, 4, 3, 1), GemmConfig(64, 128, 4, 3, 1)),
            PrefillConfig(32, GemmConfig(128, 32, 4, 2, 4), GemmConfig(32, 256, 4, 2, 16))]


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_configs(config):
    case = make_case(700, 16, 8, 320, 200, seed=1)
    out = moe_prefill.prefill_fused_moe(*case, config=config)
    assert rel(out, torch_fused_moe(*case)) <= MAX_REL


@pytest.mark.gpu
def test_tokens_that_all_pick_the_same_experts():
    """One expert runs every token (many blocks of one expert), the others none."""
    hidden, w13, w2, _, _ = make_case(2000, 64, 4, 256, 128)
    ids = torch.tensor([[3, 7, 11, 0]], device="cuda").expand(2000, 4).contiguous()
    weights = torch.softmax(torch.randn(2000, 4, device="cuda"), dim=-1)
    ref = torch_fused_moe(hidden, w13, w2, weights, ids)
    out = moe_prefill.prefill_fused_moe(hidden, w13, w2, weights, ids)
    assert rel(out, ref) <= MAX_REL


@pytest.mark.gpu
def test_replays_in_a_cuda_graph():
    hidden, w13, w2, weights, ids = make_case(512, 64, 8, 256, 128)
    moe_prefill.prefill_fused_moe(hidden, w13, w2, weights, ids)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_prefill.prefill_fused_moe(hidden, w13, w2, weights, ids)
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        new_weights, new_ids = select_experts(torch.randn(512, 64, generator=gen, device="cuda"),
                                              8, renormalize=True)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        assert rel(out, torch_fused_moe(hidden, w13, w2, weights, ids)) <= MAX_REL


@pytest.mark.gpu
@pytest.mark.parametrize("moe_prefill_on", [True, False])
def test_fused_moe_module_above_the_decode_path(moe_prefill_on):
    """FusedMoE on aiter-triton: 512 tokens x top-8 is past DECODE_MAX_PAIRS, so the kernel
    option chooses between these kernels and AITER's fused_moe; both match the torch layer."""
    from tandem.workers.ops import kernel_options
    from tandem.workers.ops.aiter_compat import aiter_available
    from tandem.workers.ops.backend import KernelBackend
    from tandem.workers.ops.kernel_options import KernelOptions
    from tandem.workers.ops.moe import FusedMoE
    if not aiter_available():
        pytest.skip("amd-aiter is not installed")
    E, k, H, I = 64, 8, 512, 256
    installed = kernel_options.current()
    try:
        kernel_options.install(KernelOptions(moe_prefill=moe_prefill_on))
        layers = [FusedMoE(E, H, I, backend=b).to("cuda", torch.bfloat16)
                  for b in (KernelBackend.TORCH, KernelBackend.AITER_TRITON)]
    finally:
        kernel_options.install(installed)
    hidden, w13, w2, _, _ = make_case(512, E, k, H, I)
    logits = torch.randn(512, E, device="cuda")
    for layer in layers:
        layer.w13.data.copy_(w13)
        layer.w2.data.copy_(w2)
    ref, out = (layer.forward_logits(hidden, logits, top_k=k, renormalize=True)
                for layer in layers)
    assert rel(out, ref) <= MAX_REL
    # summed=False: these kernels leave the k weighted outputs to the caller; AITER's
    # fused_moe and the torch layer sum them regardless.
    terms = layers[1].forward_logits(hidden, logits, top_k=k, renormalize=True, summed=False)
    assert terms.shape == ((512, k, H) if moe_prefill_on else (512, H))
    assert rel(terms.sum(dim=1) if moe_prefill_on else terms, ref) <= MAX_REL
    assert layers[0].forward_logits(hidden, logits, top_k=k, renormalize=True,
                                    summed=False).shape == (512, H)
    # A single token never gets terms (its consumer may be the fused add + norm GEMV): on the
    # decode kernels its fp32 sum, on these kernels (decode path off) one summed row.
    one = layers[1].forward_logits(hidden[:1], logits[:1], top_k=k, renormalize=True,
                                   summed=False)
    assert one.shape == (1, H) and one.dtype == torch.float32 and rel(one, ref[:1]) <= MAX_REL
    layers[1].decode_max_pairs = 0
    one = layers[1].forward_logits(hidden[:1], logits[:1], top_k=k, renormalize=True,
                                   summed=False)
    assert one.shape == (1, H) and one.dtype == torch.bfloat16 and rel(one, ref[:1]) <= MAX_REL


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_moe_engine_fp32_greedy_equals_transformers_on_these_kernels(moe_checkpoint, name):
    """With the decode kernels off and these on, every MoE batch of the tiny model (prefill,
    and decode through CUDA graphs) takes these kernels (fp32 dots, no tf32), their outputs
    summed by the next norm: greedy tokens equal fp32 transformers'."""
    from helpers.checkpoints import PARITY_LENGTHS, random_prompts

    from tandem import LLM, SamplingParams
    from tandem.workers.ops import kernel_options
    from tandem.workers.ops.aiter_compat import aiter_available
    from tandem.workers.ops.kernel_options import KernelOptions
    if not aiter_available():
        pytest.skip("amd-aiter is not installed")
    ckpt = moe_checkpoint(name)
    greedy = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    prompts = random_prompts(PARITY_LENGTHS, seed=47)
    installed = kernel_options.current()
    try:
        llm = LLM(ckpt.path, dtype="float32", device="cuda", kernels="aiter-triton",
                  max_num_seqs=8,
                  kernel_options=KernelOptions(moe_decode=False, moe_prefill=True))
        assert llm.engine.runner.graphs is not None
        for prompt, out in zip(prompts, llm.generate(prompts, greedy)):
            assert out.token_ids == ckpt.greedy(prompt, 16)
    finally:
        kernel_options.install(installed)


def test_bad_arguments_are_named():
    hidden, w13, w2 = torch.zeros(2, 8), torch.zeros(4, 8, 8), torch.zeros(4, 8, 4)
    weights, ids = torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="share one dtype"):
        moe_prefill.prefill_fused_moe(hidden.double(), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="activation='silu' only"):
        moe_prefill.prefill_fused_moe(hidden, w13, w2, weights, ids, activation="swigluoai")
    with pytest.raises(ValueError, match="contiguous expert weights"):
        moe_prefill.prefill_fused_moe(hidden, w13.transpose(1, 2), w2, weights, ids)
    with pytest.raises(ValueError, match="multiples of 4 for torch.float32"):  # 24-byte rows
        moe_prefill.prefill_fused_moe(hidden, torch.zeros(4, 12, 8), torch.zeros(4, 8, 6),
                                      weights, ids)
