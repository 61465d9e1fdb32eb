"""MoE models over 2 ranks (gloo): experts sliced (TP) or partitioned (EP, tokens moved by the
all-to-all dispatcher) give the greedy tokens of one rank and of transformers."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers.checkpoints import random_prompts

from tandem import LLM, SamplingParams
from tandem.workers.ops.moe import FusedMoE
from tandem.workers.parallel.context import ParallelContext, use_parallel
from tandem.workers.parallel.validation import check_parallel_fits

NUM_NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
LENGTHS = [1, 9, 70]


def experts_of(llm) -> list[FusedMoE]:
    return [m for m in llm.engine.model.modules() if isinstance(m, FusedMoE)]


# qwen3_moe: 8 experts, layer 1 dense; mixtral: 4 experts in every layer.
@pytest.mark.parametrize("variant,enable_expert_parallel",
                         [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)])
def test_two_ranks_give_one_ranks_greedy_tokens(moe_checkpoint, variant,
                                                enable_expert_parallel):
    ckpt = moe_checkpoint(variant)
    prompts = random_prompts(LENGTHS, seed=93)
    single = LLM(ckpt.path, dtype="float32", max_num_batched_tokens=64)
    expected = [out.token_ids for out in single.generate(prompts, GREEDY)]
    with LLM(ckpt.path, dtype="float32", max_num_batched_tokens=64, tensor_parallel_size=2,
             enable_expert_parallel=enable_expert_parallel) as llm:
        for one, split in zip(experts_of(single), experts_of(llm)):
            if enable_expert_parallel:  # half the experts, each whole
                assert split.w13.shape[0] == one.w13.shape[0] // 2
                assert split.w13.shape[1:] == one.w13.shape[1:]
            else:  # every expert, half of its intermediate size
                assert split.w13.shape[0] == one.w13.shape[0]
                assert split.w13.shape[1] == one.w13.shape[1] // 2
        actual = [out.token_ids for out in llm.generate(prompts, GREEDY)]
        # A lone sequence decodes one token per step: rank 1 owns no token to dispatch.
        [alone] = llm.generate([prompts[1]], GREEDY)
    assert actual == expected
    assert actual == [ckpt.greedy(p, NUM_NEW_TOKENS) for p in prompts]
    assert alone.token_ids == expected[1]


def test_experts_that_do_not_split_across_ranks_are_refused():
    model = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, num_local_experts=6)
    check_parallel_fits(model, 2, enable_expert_parallel=True)  # 3 experts per rank
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4: the model's 6 experts"):
        check_parallel_fits(model, 4, enable_expert_parallel=True)
    check_parallel_fits(model, 4, enable_expert_parallel=False)  # each expert sliced instead
    with use_parallel(ParallelContext(tp_rank=1, tp_size=4, enable_expert_parallel=True)):
        with pytest.raises(ValueError, match="num_experts=6"):
            FusedMoE(6, hidden_size=8, intermediate_size=16)
