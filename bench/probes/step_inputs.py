"""Host time of building one engine step's inputs (ModelRunner.prepare_inputs).

    python bench/probes/step_inputs.py                 # the build alone, on the CPU
    python bench/probes/step_inputs.py --device cuda   # the build and its copy to the GPU

The step's inputs are built on the host before its first kernel can start, so for a prefill
their build time is part of TTFT, and for decode it is host work that asynchronous scheduling
must hide under the previous step. Cases: one 8192-token prompt; three 2000-token prompts and
a 1500-token chunk over 1000 cached tokens; decode batches of 1, 64 and 256 sequences at 1024
tokens of context (65 blocks of 16 each). Random token ids and shuffled block ids; the median
of 50 builds after 5 warm-ups. With a CUDA target device each build ends when its inputs are
on the GPU (the copy, and the kernels that convert their int32 parts, synchronized).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from types import SimpleNamespace

import torch

from tandem.workers.engine.model_runner import ModelRunner
from tandem.workers.engine.scheduler import ScheduledSequence, SchedulerOutput

BLOCK = 16


def sequence(num_tokens: int, computed: int, seed: int) -> SimpleNamespace:
    """What prepare_inputs reads of a Sequence: its token ids, computed count, block table."""
    rng = random.Random(seed)
    return SimpleNamespace(token_ids=[rng.randrange(150_000) for _ in range(num_tokens)],
                           num_computed_tokens=computed,
                           block_table=rng.sample(range(100_000), -(-(num_tokens + 1) // BLOCK)))


def cases() -> dict[str, SchedulerOutput]:
    prompts = [ScheduledSequence(sequence(2000, 0, seed), 2000, True) for seed in range(3)]
    chunk = ScheduledSequence(sequence(3000, 1000, 9), 1500, False)
    out = {"prefill 8192": SchedulerOutput([ScheduledSequence(sequence(8192, 0, 0), 8192, True)],
                                           True),
           "prefill 3 x 2000 + chunk": SchedulerOutput([*prompts, chunk], True)}
    for batch in (1, 64, 256):
        out[f"decode {batch} x 1024"] = SchedulerOutput(
            [ScheduledSequence(sequence(1025, 1024, seed), 1, True) for seed in range(batch)],
            False)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="the inputs' device (cpu, cuda)")
    device = torch.device(parser.parse_args().device)
    runner = SimpleNamespace(block_size=BLOCK, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"{'case':<26} {'host ms':>8}  ({device})")
    for name, batch in cases().items():
        for _ in range(5):
            ModelRunner.prepare_inputs(runner, batch)
        times = []
        for _ in range(50):
            sync()
            started = time.perf_counter()
            ModelRunner.prepare_inputs(runner, batch)
            sync()
            times.append(time.perf_counter() - started)
        print(f"{name:<26} {statistics.median(times) * 1e3:8.3f}")


if __name__ == "__main__":
    main()
