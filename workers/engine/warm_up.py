"""Synthetic requests through a freshly built engine, before it serves, so the kernel variants
real traffic reaches are compiled (Triton JIT) at startup instead of inside a request.

    report = warm_up(engine)      # every request finished; the engine is idle again

Which variants a step needs depends on its shape: prompt lengths under and over 256 tokens
(AITER's unified_attention switches tile sizes there: BLOCK_M 16 or 128), one, several and
sixteen prompts in one step (Triton specializes the kernels' num_seqs on == 1 and on multiples
of 16), a prompt longer than the step budget (its later chunks attend over cached context),
contexts over 512 keys at a few lengths (the 3D kernel's segment count follows them), and
decode steps at several batch sizes. Known gap, measured on an H200 pair
(bench/results/disagg-warmup-h200x2-s6.log): a prefill worker still compiles four AITER
unified_attention 2D variants while serving, ~1 s each, inside the first requests' TTFT. The
2D kernel runs only on steps that continue over <= 512 cached keys (a later chunk of a short
prompt, a prefix-cache hit); these random fresh prompts take the SDPA path and the chunked one
the 3D kernel. Rounds with cached context (one and several sequences, block-table widths
divisible by 16 and not: the variants' keys differ in exactly that) would close it. The requests cover those shapes within the
engine's limits (max_model_len, max_num_batched_tokens, max_num_seqs, free KV blocks) and
generate two tokens each (one decode step). Their token ids are random, so no real prompt
shares a cached prefix with them. The worker runs this on GPUs (workers/server.py); the
Triton compile watch (workers/ops/jit_compiles.py) shows what moved to startup.
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


def _max_prompt_tokens(engine) -> int:
    """The longest prompt (+ 2 generated tokens) that fits in half of the free KV blocks."""
    manager = engine.block_manager
    return manager.num_free_blocks // 2 * manager.block_size - 2
