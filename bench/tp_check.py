"""Does tensor parallelism change the tokens of a full-size model? TP=N against TP=1, greedy.

    python -m tandem.bench.tp_check --tp 2 --model llama3-8b --prompts 4 --tokens 32

Writes a real bf16 checkpoint of the shape first (transformers' random init on the GPU,
save_pretrained to --workdir: 16 GB for llama3-8b), so both runs load identical weights (the
engine's load_format="dummy" draws each rank's shard separately and would not). Then each
prompt's first --tokens greedy tokens under TP=1 and TP=N are compared; in bf16 the all-reduce
adds partial sums in a different order than one matmul, so a token may legitimately flip where
the top two logits nearly tie: the table shows the first differing step and the TP=1 margin
(top-1 minus top-2 log-probability) there.
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from tandem.bench.engine_models import MODELS, write_model_dir


def write_checkpoint(name: str, root: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = write_model_dir(name, root)
    started = time.monotonic()
    config = AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, max_shard_size="4GB")
    del model
    torch.cuda.empty_cache()
    print(f"wrote {name} to {path} in {time.monotonic() - started:.0f} s", flush=True)
    return path


def greedy(path: Path, tp: int, prompts: list[list[int]], tokens: int):
    from tandem import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens, logprobs=2)
    with LLM(path, dtype="bfloat16", tensor_parallel_size=tp, max_model_len=2048,
             kernels="auto") as llm:
        outs = llm.generate(prompts, params)
    torch.cuda.empty_cache()
    return outs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench.tp_check")
    parser.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args(argv)
    if torch.cuda.device_count() < args.tp:
        print(f"needs {args.tp} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(dir=args.workdir) as root:
        path = write_checkpoint(args.model, Path(root))
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 32000, (n,), generator=gen).tolist()
                   for n in (16, 100, 400, 1000)[:args.prompts]]
        one = greedy(path, 1, prompts, args.tokens)
        many = greedy(path, args.tp, prompts, args.tokens)
    same = 0
    print(f"{'prompt':>7} {'identical':>9} {'first diff':>10} {'TP=1 margin there':>18}")
    for prompt, a, b in zip(prompts, one, many):
        diff = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                    None)
        same += diff is None
        margin = ""
        if diff is not None:
            top = [logprob for _, logprob in a.logprobs[diff].top_logprobs]
            margin = f"{top[0] - top[1]:.3f}" if len(top) >= 2 else "?"
        print(f"{len(prompt):>7} {str(diff is None):>9} {str(diff):>10} {margin:>18}")
    # The first generated token has the same prefix in both runs: compare its distribution.
    first = [abs(dict(a.logprobs[0].top_logprobs).get(t, float("nan")) - lp)
             for a, b in zip(one, many) for t, lp in b.logprobs[0].top_logprobs]
    worst = max((d for d in first if not math.isnan(d)), default=float("nan"))
    print(f"TP={args.tp} vs TP=1, {args.model}, bf16: {same}/{len(prompts)} prompts give "
          f"identical first {args.tokens} tokens; first-token top-2 log-probabilities differ "
          f"by at most {worst:.4f} ({sum(map(math.isnan, first))} not in the other's top-2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
