"""The torch backend on the GPU gives the tokens the CPU gives (fp32), and runs in bf16."""
from __future__ import annotations

import pytest
from helpers.checkpoints import PARITY_LENGTHS, random_prompts

from tandem import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)


def test_gpu_fp32_greedy_equals_transformers(checkpoint):
    ckpt = checkpoint("qwen3")
    prompts = random_prompts(PARITY_LENGTHS, seed=31)
    llm = LLM(ckpt.path, dtype="float32", device="cuda")
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        assert out.token_ids == ckpt.greedy(prompt, 32)


def test_gpu_bf16_runs_batch(checkpoint):
    llm = LLM(checkpoint("llama").path, dtype="bfloat16", device="cuda")
    outs = llm.generate(random_prompts(PARITY_LENGTHS, seed=32), GREEDY)
    assert all(len(o.token_ids) == 32 for o in outs)


# -- the aiter-triton backend (our Triton kernels + AITER's), decode through CUDA graphs -------

def _aiter_or_skip():
    from tandem.workers.ops.aiter_compat import aiter_available
    if not aiter_available():
        pytest.skip("amd-aiter is not installed")


def test_aiter_triton_fp32_greedy_equals_transformers_with_graphs(checkpoint):
    """fp32: every kernel path is exact enough for transformers' greedy tokens; decode steps
    replay CUDA graphs (batch sizes 1..8 padded to the captured sizes)."""
    _aiter_or_skip()
    ckpt = checkpoint("qwen3")
    prompts = random_prompts(PARITY_LENGTHS, seed=33)
    llm = LLM(ckpt.path, dtype="float32", device="cuda", kernels="aiter-triton", max_num_seqs=8)
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    replays = graphs.num_replays
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        assert out.token_ids == ckpt.greedy(prompt, 32)
    # Eight prompts fill the largest graph: its staging buffer holds their packed inputs, so
    # every decode step (31 of a 32-token generation) replays.
    assert len(prompts) == 8 and graphs.num_replays - replays >= 31
    for prompt in prompts[:3]:  # batch 1 alone (padding rows never leak into real ones)
        assert llm.generate([prompt], GREEDY)[0].token_ids == ckpt.greedy(prompt, 32)


def _assert_greedy_where_decided(ckpt, prompt, tokens, margin=0.05):
    """Each bf16 greedy token equals fp32 transformers' argmax given the same prefix (teacher
    forcing on our own tokens) wherever fp32's top-1 leads its top-2 by more than `margin`
    logits; near-ties may go either way in bf16. EOS is out of the running, as GREEDY's
    min_tokens keeps it out of ours. Returns how many steps were decided."""
    logits = ckpt.logits(prompt + tokens)[len(prompt) - 1:-1]  # [n, V] fp32
    logits[:, ckpt.model.config.eos_token_id] = float("-inf")
    decided = 0
    for i, token in enumerate(tokens):
        top = logits[i].topk(2)
        if top.values[0] - top.values[1] < margin:
            continue
        assert token == top.indices[0].item(), f"step {i}: {token} != {top.indices[0].item()}"
        decided += 1
    return decided


def test_aiter_triton_bf16_tokens_follow_fp32_reference(checkpoint):
    """bf16 on GPU (graphs, prefix caching, chunked prefill through unified_attention) against
    the fp32 reference: same tokens until the first near-tie."""
    _aiter_or_skip()
    ckpt = checkpoint("llama")
    prompts = random_prompts(PARITY_LENGTHS, seed=34)
    llm = LLM(ckpt.path, dtype="bfloat16", device="cuda", kernels="aiter-triton",
              max_num_batched_tokens=96)  # 129..300-token prompts prefill in chunks
    decided = []
    for _ in range(2):  # the second pass hits the prefix cache
        for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
            decided.append(_assert_greedy_where_decided(ckpt, prompt, out.token_ids))
    assert sum(decided) >= len(decided) * 16, decided  # the check was not vacuous
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("name", ["llama_h128", "qwen3_h128"])
def test_whole_block_decode_kernel_bf16_tokens_follow_fp32_reference(checkpoint, name):
    """Head dim 128, 2 KV heads, with and without Qwen3's QK norm in the RoPE launch before
    it: decode steps of up to 8 sequences run the whole-block CUDA kernel (through CUDA
    graphs) where nvcc and sm_90 allow; tokens as in the test above."""
    _aiter_or_skip()
    import torch

    from tandem.workers.ops.attention_gpu import use_block_decode
    ckpt = checkpoint(name)
    llm = LLM(ckpt.path, dtype="bfloat16", device="cuda", kernels="aiter-triton",
              max_num_seqs=8)
    k_cache, v_cache = llm.engine.runner.kv_caches[0]
    probe = torch.empty(1, 4, 128, dtype=torch.bfloat16, device="cuda")
    if not use_block_decode(probe, k_cache, v_cache):
        pytest.skip("the whole-block decode kernel cannot run here (see the log for why)")
    prompts = random_prompts(PARITY_LENGTHS, seed=35)
    decided = [_assert_greedy_where_decided(ckpt, prompt, out.token_ids)
               for prompt, out in zip(prompts, llm.generate(prompts, GREEDY))]
    assert sum(decided) >= len(decided) * 16, decided


def test_asynchronous_scheduling_gives_the_tokens_of_one_step_at_a_time(checkpoint):
    """With CUDA graphs and a real device queue: queued-ahead decode steps read their input
    tokens on the device; every sampling mode, rows that force the step-at-a-time path, and
    requests waiting for a slot give the same tokens either way."""
    _aiter_or_skip()
    path = checkpoint("llama").path
    prompts = random_prompts([5, 17, 33, 2, 40, 9, 21, 12, 64, 3], seed=35)
    params = [
        SamplingParams(temperature=0, max_tokens=40),
        SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=36),
        SamplingParams(temperature=0.7, top_k=20, min_p=0.05, seed=9, max_tokens=30,
                       min_tokens=20),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=1.0, seed=3, max_tokens=33),
        SamplingParams(temperature=0, max_tokens=24, logprobs=2),
        SamplingParams(temperature=0.8, seed=1, max_tokens=28, repetition_penalty=1.2),
    ] + [SamplingParams(temperature=0, max_tokens=20 + i, ignore_eos=True) for i in range(3)]
    outputs = {}
    for async_scheduling in (False, True):
        llm = LLM(path, dtype="float32", device="cuda", kernels="aiter-triton", max_num_seqs=4,
                  async_scheduling=async_scheduling)
        assert llm.engine.async_scheduling is async_scheduling
        outputs[async_scheduling] = [(o.token_ids, o.finish_reason)
                                     for o in llm.generate(prompts, params)]
        manager = llm.engine.block_manager
        assert manager.num_free_blocks == manager.num_blocks
        llm.shutdown()
    assert outputs[True] == outputs[False]
