"""The torch backend on the GPU gives the tokens the CPU gives (fp32), and runs in bf16."""
from __future__ import annotations

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
