"""Synthetic requests through a freshly built engine, before it serves, so the kernel variants
real traffic reaches are compiled (Triton JIT) at startup instead of inside a request.

    report = warm_up(engine)      # every request finished; the engine is idle again

Which variants a step needs depends on its shape: prompt lengths under and over 256 tokens
(AITER's unified_attention switches tile sizes there: BLOCK_M 16 or 128), one, several and
sixteen prompts in one step (Triton specializes the kernels' num_seqs on == 1 and on multiples
of 16), a prompt longer than the step budget, and decode steps at several batch sizes.

Fresh prompts take torch SDPA, or FlashAttention-4 on Hopper where it is installed (several
prompts in a step; attention_gpu.py, gpu/fa4_prefill.py), which also takes steps of 256+ new
tokens over cached context: the rounds below reach both FA4 forms, so their one-time compiles
(a few seconds each) happen here. unified_attention runs on the other steps where some
sequence continues over cached context, and picks its 2D kernel for <= 512 cached keys or
many query tiles and its 3D kernel otherwise, with 16, 32 or 64 segments by the step's query
tiles. Without such steps a prefill worker compiles 2D variants while serving, about a second
each, inside the first requests' TTFT. So CONTINUATIONS builds those steps on purpose: a filler prompt of (step budget - c)
tokens and a target prompt of c + q tokens go in together; the scheduler fills the budget with
the filler and the target's first c tokens, and the next step continues the target's q tokens
over c cached keys, with the extra prompts (fresh) joining it. The block-table width, the other
integer the kernels specialize on, is rounded up by ModelRunner
(packed_inputs.TABLE_WIDTH_MULTIPLE), so it needs no rounds of its own.

Every request stays within the engine's limits (max_model_len, max_num_batched_tokens,
max_num_seqs, free KV blocks: a round that cannot fit is cut or skipped) and generates two
tokens (one decode step). Token ids are random, so no real prompt shares a cached prefix with
them. The worker runs this on GPUs (workers/server.py); the Triton compile watch
(workers/ops/jit_compiles.py) names any variant compiled later, while serving.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

from tandem.common.logging import get_logger
from tandem.common.sampling_params import SamplingParams

logger = get_logger(__name__)
# Prompt lengths, one request each, then steps of several prompts together (each round is cut
# to max_num_seqs prompts): long and short (BLOCK_M 128), short only (BLOCK_M 16), sixteen.
SINGLE_LENGTHS = (1, 17, 200, 300, 700, 1000, 2000)
TOGETHER_ROUNDS = ((40, 130, 270, 600), (20, 50, 90), (24,) * 16)
CHUNKED_EXTRA = 37  # past max_num_batched_tokens: a prompt prefilled in two or more chunks
# (cached keys c, new tokens q, fresh prompts joining the continuing step), module docstring.
# On an 8-KV-head, GQA-4 model on 132 SMs they reach, in order: the 2D kernel with BLOCK_M 16
# for one, three and sixteen sequences, with BLOCK_M 128 for one, three and sixteen; the 3D
# kernel with 16 segments (one, three, sixteen sequences), 32 and 64 segments.
CONTINUATIONS = (
    (100, 50, ()), (100, 50, (30, 30)), (100, 50, (8,) * 15),
    (100, 300, ()), (100, 300, (30, 30)), (100, 300, (8,) * 15),
    (600, 37, ()), (600, 37, (10, 10)), (600, 37, (8,) * 15), (600, 10, ()), (600, 3, ()),
)


@dataclass(frozen=True)
class WarmUpReport:
    num_requests: int
    num_steps: int
    seconds: float


def warm_up(engine, seed: int = 0) -> WarmUpReport:
    """Runs the synthetic requests to completion (module docstring). The engine must be idle."""
    if engine.has_unfinished:
        raise RuntimeError("warm_up needs an idle engine")
    started = time.monotonic()
    config, resolved = engine.config, engine.resolved
    longest = min(resolved.max_model_len - 3, _max_prompt_tokens(engine))
    rounds = [[n] for n in SINGLE_LENGTHS]
    rounds += [list(lengths[:config.max_num_seqs]) for lengths in TOGETHER_ROUNDS]
    rounds.append([config.max_num_batched_tokens + CHUNKED_EXTRA])
    rounds += [lengths[:config.max_num_seqs]
               for lengths in _continuation_rounds(config.max_num_batched_tokens)]
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=2, min_tokens=2, temperature=0.0, ignore_eos=True)
    num_requests = num_steps = 0
    for lengths in rounds:
        for n in lengths:
            n = min(n, longest)
            if n < 1:
                continue
            prompt = [rng.randrange(resolved.vocab_size) for _ in range(n)]
            engine.add_request(prompt, params, f"warm-up-{num_requests}")
            num_requests += 1
        while engine.has_unfinished:
            engine.step()
            num_steps += 1
    report = WarmUpReport(num_requests, num_steps, time.monotonic() - started)
    logger.info("warm-up: %d synthetic requests, %d steps in %.1f s", report.num_requests,
                report.num_steps, report.seconds)
    return report


def _continuation_rounds(budget: int) -> list[list[int]]:
    """CONTINUATIONS as prompt lengths [filler, target, *extras] (module docstring): the filler
    leaves c of the step budget to the target, so its next step continues over c cached keys.
    A budget of c or less gets c = budget - 1 (small test engines)."""
    rounds = []
    for cached, new, extras in CONTINUATIONS:
        cached = min(cached, budget - 1)
        if cached < 1:
            continue
        rounds.append([budget - cached, cached + new, *extras])
    return rounds


def _max_prompt_tokens(engine) -> int:
    """The longest prompt (+ 2 generated tokens) that fits in half of the free KV blocks."""
    manager = engine.block_manager
    return manager.num_free_blocks // 2 * manager.block_size - 2
