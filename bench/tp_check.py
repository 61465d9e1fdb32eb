"""Does tensor parallelism change what a full-size model computes? TP=N against TP=1, bf16.

    python -m tandem.bench.tp_check --workdir /tmp          # 2 GPUs, Llama-3-8B shape, < 2 min
    python -m tandem.bench.tp_check --device cpu --model tiny --lengths 16,60   # CPU, gloo

Both runs load one checkpoint written here first (transformers' random init on the device,
reshaped as below, save_pretrained to --workdir: 16 GB for llama3-8b): load_format="dummy"
draws each rank's shard separately and would not give both runs the same weights.

Per prompt (--lengths, random token ids), three comparisons:
  free-running     TP=1 and TP=N each generate --tokens greedy tokens; the first position where
                   they differ, and TP=1's top-1 minus top-2 log-probability margin there.
  teacher-forced   TP=1's sequence scored under both: one request per position k with the
                   prompt + TP=1's first k tokens (prefix caching off, so each is a fresh
                   prefill; max_tokens 1, top-20 logprobs). TP=N's argmax is compared with
                   TP=1's greedy token at every position (one flip no longer derails the rest)
                   and with TP=1's argmax under the same prefill scoring; each mismatch is
                   listed with TP=1's margins.
  log-probabilities |dlogp|: the largest difference of a top-20 log-probability between TP=1
                   and TP=N over the teacher-forced positions.
PASS (exit 0) needs every token equal and |dlogp| within the limit below.

Why reshape the weights (--weights peaked, default). With transformers' init the logits over the
128k vocabulary are nearly flat: the top two differ by a median 0.2 nats and often by one bf16
step, so any change of summation order flips tokens (last run: 0/4 prompts identical, every
first difference at a 0.03-0.09 margin). That says nothing about TP. The peaked construction,
deterministic (seed 0) and made on the device in seconds:
  * every layer (attention, MLP, norms) keeps transformers' init, so every TP-sharded part runs
    at full shape: column-parallel q/k/v/gate/up, row-parallel o/down with their all-reduces,
    the vocab-parallel embedding and lm_head;
  * the embedding is rescaled so that each token's own embedding direction keeps a share rho of
    the final residual stream h_L (the 5th percentile of cos(e_x, h_L) on a calibration prompt;
    default rho = 2.5 sqrt(2 ln V / D), 0.19 for Llama-3-8B): the 32 layers write the rest;
  * lm_head row perm[x] = c e_x / rms(e_x) for a fixed random permutation perm, c set for a
    ~16-nat self term: the next token after x is perm[x], and tokens walk perm's cycles.
Measured at the 8B shape on CPU (same init distribution, layers streamed): cos median 0.21 (5th
percentile 0.19), the layers' part |h_L - e_x| / |h_L| 0.98 (95% of the residual's energy),
top-1 margins 9.2-12 nats (plain init: median 0.22, min 0), top-1 = perm[x] everywhere.
The flip side: greedy tokens are now robust to rounding and to bugs alike. On that CPU model a
sign error in rank 1's slice of one layer's o_proj, or of every layer's, changed no top-1
token; it moved the top-20 log-probabilities by 0.46 / 5.2 nats (median; max 1.0 / 8.8), while
TP=2's rounding (row-parallel partial sums in bf16) moved them by 0.13 (max 0.28). So
log-probabilities are the TP-sensitive part of this check: the calibration prints both
references on this run's weights, and |dlogp| may be at most twice the emulated rounding (at
least one bf16 step at 16, 0.125); the verdict says whether that limit resolves the
one-layer bug. --weights random keeps the plain init (flat logits) for comparison.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.bench.engine_models import MODELS, write_model_dir

TOP_K = 20
TARGET_LOGIT = 16.0
SKIP = 16  # calibration positions before this one are left out (no prompt is that short)


def tiny_config():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512,
                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=2048, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, bos_token_id=0, eos_token_id=2047,
                       architectures=["LlamaForCausalLM"], dtype="bfloat16")


@torch.no_grad()
def residuals(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding output e, final residual h before the last norm), fp32, [T, D]."""
    seen = {}
    hooks = [model.model.embed_tokens.register_forward_hook(
                 lambda m, i, o: seen.__setitem__("e", o)),
             model.model.norm.register_forward_pre_hook(
                 lambda m, i: seen.__setitem__("h", i[0]))]
    try:
        model(ids[None])
    finally:
        for hook in hooks:
            hook.remove()
    return seen["e"][0].float(), seen["h"][0].float()


def rms(x: torch.Tensor) -> torch.Tensor:
    return x.pow(2).mean(-1).sqrt()


@torch.no_grad()
def peak_weights(model, rho: float, ids: torch.Tensor, seed: int = 0) -> None:
    """The peaked construction of the module docstring, in place."""
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    assert emb.data_ptr() != head.data_ptr(), "needs an untied lm_head"
    for _ in range(8):  # the layers' output depends on the embedding scale: iterate
        e, h = residuals(model, ids)
        cos = torch.nn.functional.cosine_similarity(e, h, dim=-1)[SKIP:].quantile(0.05).item()
        if abs(cos - rho) < 0.01:
            break
        # e and h - e orthogonal: cot(angle) = |e| / |h - e| grows with the scale
        emb.mul_((rho / math.sqrt(1 - rho**2)) / (max(cos, 1e-6) / math.sqrt(1 - cos**2)))
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(emb.shape[0], generator=gen).to(emb.device)
    c = TARGET_LOGIT / (emb.shape[1] * rho)
    for start in range(0, emb.shape[0], 16384):  # in slices: no fp32 copy of the whole table
        rows = emb[start:start + 16384].float()
        head.index_copy_(0, perm[start:start + 16384],
                         (c * rows / rms(rows)[:, None]).to(head.dtype))
    model.perm = perm


def _split_forward(linear, parts: int, negate_last: bool):
    """linear's forward as `parts` partial matmuls over input slices, each rounded to the
    weight dtype and summed (a row-parallel layer under TP=parts: torch.distributed sums the
    ranks' partial outputs in that dtype); negate_last: the last slice with the wrong sign."""
    weight, cols = linear.weight, linear.weight.shape[1] // parts

    def forward(x):
        y = None
        for p in range(parts):
            part = F.linear(x[..., p * cols:(p + 1) * cols], weight[:, p * cols:(p + 1) * cols])
            part = -part if negate_last and p == parts - 1 else part
            y = part if y is None else y + part
        return y if linear.bias is None else y + linear.bias
    return forward


@contextlib.contextmanager
def patched(model, tp: int, bug: bool = False):
    """Every o_proj and down_proj with TP=tp's rounding; or (bug) only the middle layer's o_proj
    with rank tp-1's input slice negated, as a sharding bug confined to one layer would do."""
    layers = model.model.layers
    targets = [layers[len(layers) // 2].self_attn.o_proj] if bug else \
        [m for layer in layers for m in (layer.self_attn.o_proj, layer.mlp.down_proj)]
    for linear in targets:
        linear.forward = _split_forward(linear, tp, negate_last=bug)
    try:
        yield
    finally:
        for linear in targets:
            del linear.forward  # back to the class's forward


def top_dlogp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per position: the largest |a - b| over a's top-20 tokens (log-probabilities)."""
    top = a.topk(TOP_K, dim=-1).indices
    return (a.gather(-1, top) - b.gather(-1, top)).abs().amax(-1)


@torch.no_grad()
def calibration(model, ids: torch.Tensor, tp: int) -> dict:
    """How much the layers contribute, and how far TP rounding and a one-layer sharding bug
    move the top-20 log-probabilities, on a prompt (positions from SKIP on)."""
    def logprobs():
        e, h = residuals(model, ids)
        return e[SKIP:], h[SKIP:], torch.log_softmax(
            model.lm_head(model.model.norm(h[SKIP:].to(model.lm_head.weight.dtype))).float(), -1)

    e, h, full = logprobs()
    bare = torch.log_softmax(model.lm_head(model.model.norm(
        e.to(model.lm_head.weight.dtype))).float(), -1)
    with patched(model, tp):
        rounding = top_dlogp(full, logprobs()[2])
    with patched(model, tp, bug=True):
        _, _, buggy = logprobs()
    bug = top_dlogp(full, buggy)
    top2 = full.topk(2, dim=-1)
    centred = lambda x: x - x.mean(-1, keepdim=True)  # noqa: E731
    cos = torch.nn.functional.cosine_similarity(e, h, dim=-1)
    margins = top2.values[:, 0] - top2.values[:, 1]
    return dict(
        cos=cos.median().item(), cos_p5=cos.quantile(0.05).item(),
        layers_norm=(rms(h - e) / rms(h)).median().item(),
        layers_logit_rms=rms(centred(full - bare)).median().item(),
        logit_rms=rms(centred(full)).median().item(),
        margin_median=margins.median().item(), margin_min=margins.min().item(),
        top1_is_perm=(top2.indices[:, 0] == model.perm[ids[SKIP:]]).float().mean().item()
        if hasattr(model, "perm") else None,
        rounding_max=rounding.max().item(), bug_median=bug.median().item(),
        bug_max=bug.max().item(),
        bug_flips=(buggy.argmax(-1) != top2.indices[:, 0]).float().mean().item())


def write_checkpoint(args, root: Path) -> tuple[Path, dict]:
    from transformers import AutoConfig, AutoModelForCausalLM

    started = time.monotonic()
    if args.model == "tiny":
        path = root / "tiny"
        tiny_config().save_pretrained(path)
    else:
        path = write_model_dir(args.model, root)
    config = AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    model.eval()
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, config.vocab_size, (256,), generator=gen).to(args.device)
    dim, vocab = config.hidden_size, config.vocab_size
    rho = args.rho or min(0.9, 2.5 * math.sqrt(2 * math.log(vocab) / dim))
    if args.weights == "peaked":
        peak_weights(model, rho, ids)
    report = calibration(model, ids, args.tp)
    report["rho_target"] = rho if args.weights == "peaked" else None
    model.save_pretrained(path, max_shard_size="4GB")
    del model
    if args.device != "cpu":
        torch.cuda.empty_cache()
    report["seconds"] = time.monotonic() - started
    return path, report


def run_engine(path: Path, tp: int, prompts: list[list[int]], args,
               teacher: list[list[int]] | None = None):
    """Free-running greedy outputs, then each sequence prompt + teacher[i][:k] scored."""
    from tandem import LLM, SamplingParams

    free = SamplingParams(temperature=0, max_tokens=args.tokens, min_tokens=args.tokens,
                          logprobs=TOP_K)
    one = SamplingParams(temperature=0, max_tokens=1, logprobs=TOP_K)
    started = time.monotonic()
    with LLM(path, dtype=args.dtype, device=args.device, tensor_parallel_size=tp,
             max_model_len=max(args.length_list) + args.tokens + 16,
             kernels="torch" if args.device == "cpu" else "auto",
             enable_prefix_caching=False) as llm:
        ready = time.monotonic()
        outs = llm.generate(prompts, free)
        teacher = teacher or [o.token_ids for o in outs]
        seqs = [p + t[:k] for p, t in zip(prompts, teacher) for k in range(args.tokens)]
        scored = llm.generate(seqs, one)
    if args.device != "cpu":
        torch.cuda.empty_cache()
    n = args.tokens
    scored = [[s.logprobs[0] for s in scored[i * n:(i + 1) * n]] for i in range(len(prompts))]
    print(f"TP={tp}: engine ready in {ready - started:.0f} s, generate + score "
          f"{len(seqs)} sequences in {time.monotonic() - ready:.0f} s", flush=True)
    return outs, scored


def margin(logprob) -> float:
    top = [lp for _, lp in logprob.top_logprobs]
    return top[0] - top[1] if len(top) >= 2 else float("nan")


def max_dlogp(a, b) -> float:
    """Largest |logprob difference| over the tokens in both top-20 lists."""
    other = dict(b.top_logprobs)
    return max((abs(lp - other[t]) for t, lp in a.top_logprobs if t in other), default=0.0)


def compare(prompts, one, one_scored, many, many_scored, tp: int) -> tuple[list, list[str]]:
    rows, details = [], []
    for i, prompt in enumerate(prompts):
        a, b = one[i].token_ids, many[i].token_ids
        diff = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        tf_greedy = tf_scored = 0
        for k, (s1, sn) in enumerate(zip(one_scored[i], many_scored[i])):
            tf_greedy += sn.token_id == a[k]
            tf_scored += sn.token_id == s1.token_id
            if sn.token_id != a[k] or sn.token_id != s1.token_id:
                details.append(f"  prompt {len(prompt)}, position {k}: TP=1 greedy {a[k]} "
                               f"(margin {margin(one[i].logprobs[k]):.3f}), TP=1 scored "
                               f"{s1.token_id} (margin {margin(s1):.3f}), TP={tp} scored "
                               f"{sn.token_id}")
        rows.append(dict(
            length=len(prompt), identical=diff is None, first_diff=diff,
            margin_at_diff=None if diff is None else margin(one[i].logprobs[diff]),
            tf_greedy=tf_greedy, tf_scored=tf_scored, n=len(one_scored[i]),
            min_margin=min(margin(lp) for lp in one[i].logprobs),
            dlogp=max(max_dlogp(x, y) for x, y in zip(one_scored[i], many_scored[i])),
            path_dlogp=max(max_dlogp(x, y) for x, y in zip(one[i].logprobs, one_scored[i]))))
    return rows, details


def format_table(rows: list[dict], tokens: int, tp: int) -> str:
    lines = [f"{'prompt':>6} {'identical':>9} {'first diff':>10} {'margin there':>12} "
             f"{'TF vs greedy':>12} {'TF vs scored':>12} {'min margin':>10} {'|dlogp|':>8}"]
    for r in rows:
        there = "-" if r["margin_at_diff"] is None else f"{r['margin_at_diff']:.3f}"
        lines.append(
            f"{r['length']:>6} {'yes' if r['identical'] else 'no':>9} "
            f"{'-' if r['first_diff'] is None else r['first_diff']:>10} {there:>12} "
            f"{r['tf_greedy']:>5}/{r['n']:<6} {r['tf_scored']:>5}/{r['n']:<6} "
            f"{r['min_margin']:>10.3f} {r['dlogp']:>8.4f}")
    return "\n".join(lines)


def dlogp_limit(cal: dict) -> float:
    """TP=N may move a top-20 log-probability by twice the emulated TP rounding on the
    calibration prompt, and by at least one bf16 step of the top logit (TARGET_LOGIT)."""
    return max(2 * cal["rounding_max"], 2.0 ** (math.floor(math.log2(TARGET_LOGIT)) - 7))


def calibration_line(args, cal: dict) -> str:
    target = "" if cal["rho_target"] is None else f" (target {cal['rho_target']:.3f})"
    perm = "" if cal["top1_is_perm"] is None else \
        f"; top-1 = perm[x] at {cal['top1_is_perm']:.0%} of positions"
    return (f"wrote {args.model} ({args.weights} weights) in {cal['seconds']:.0f} s. On a "
            f"calibration prompt: cos(e_x, h_L) median {cal['cos']:.3f}, 5th percentile "
            f"{cal['cos_p5']:.3f}{target}; the layers' part |h_L - e_x| / |h_L| median "
            f"{cal['layers_norm']:.3f}; without the layers every logit moves by "
            f"{cal['layers_logit_rms']:.2f} nats RMS (the logits' own spread: "
            f"{cal['logit_rms']:.2f}); top-1 margin median {cal['margin_median']:.2f}, min "
            f"{cal['margin_min']:.3f}{perm}.\nTop-20 |dlogp| on that prompt: TP={args.tp} "
            f"rounding emulated (row-parallel partial sums in {args.dtype}) max "
            f"{cal['rounding_max']:.3f}; a sign error in rank {args.tp - 1}'s slice of one "
            f"layer's o_proj: median {cal['bug_median']:.3f}, max {cal['bug_max']:.3f} "
            f"(changes the top-1 at {cal['bug_flips']:.0%} of positions)")


def make_prompts(args, vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, min(vocab_size - 1, 32000), (n,), generator=gen).tolist()
            for n in args.length_list]


def check(args, path: Path, cal: dict, prompts: list[list[int]], many_path: Path | None = None,
          many_tp: int | None = None) -> tuple[bool, list[dict]]:
    """TP=1 on `path` against TP=many_tp (default args.tp) on many_path (default `path`);
    prints the table and the verdict."""
    many_tp = many_tp or args.tp
    one, one_scored = run_engine(path, 1, prompts, args)
    many, many_scored = run_engine(many_path or path, many_tp, prompts, args,
                                   teacher=[o.token_ids for o in one])
    rows, details = compare(prompts, one, one_scored, many, many_scored, many_tp)
    print(f"\nTP={many_tp} vs TP=1, {args.model} ({args.weights} weights), {args.dtype}, first "
          f"{args.tokens} tokens; margin: TP=1's top-1 minus top-2 logprob (nats); TF: "
          f"teacher-forced argmax agreement with TP=1's greedy tokens / TP=1's scored argmax")
    print(format_table(rows, args.tokens, many_tp))
    print("\n".join(details) or "no teacher-forced mismatch")
    dlogp, limit = max(r["dlogp"] for r in rows), dlogp_limit(cal)
    tokens_ok = all(r["identical"] and r["tf_greedy"] == r["n"] == r["tf_scored"] for r in rows)
    ok = tokens_ok and dlogp <= limit
    print(f"{'PASS' if ok else 'FAIL'}: {sum(r['identical'] for r in rows)}/{len(rows)} prompts "
          f"identical for {args.tokens} tokens; teacher-forced "
          f"{sum(r['tf_greedy'] for r in rows)}/{sum(r['n'] for r in rows)}; top-20 |dlogp| "
          f"max {dlogp:.3f} (limit {limit:.3f}; a one-layer sharding bug reaches "
          f"{cal['bug_max']:.3f} on the calibration prompt: "
          f"{'caught' if limit < cal['bug_max'] else 'NOT resolved at this size'}). For scale: "
          f"TP=1's own decode steps vs its prefill scoring differ by up to "
          f"{max(r['path_dlogp'] for r in rows):.3f}", flush=True)
    return ok, rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench.tp_check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b", choices=sorted([*MODELS, "tiny"]))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--weights", default="peaked", choices=("peaked", "random"))
    parser.add_argument("--rho", type=float, help="embedding share of the final residual "
                        "(cosine, 5th percentile); default 2.5 sqrt(2 ln V / D)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--lengths", default="16,100,400,1000", help="prompt lengths")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--workdir", type=Path, help="where the checkpoint is written")
    args = parser.parse_args(argv)
    args.length_list = [int(n) for n in args.lengths.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        print(f"needs {args.tp} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    started = time.monotonic()
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as root:
        path, cal = write_checkpoint(args, Path(root))
        print(calibration_line(args, cal), flush=True)
        from transformers import AutoConfig

        prompts = make_prompts(args, AutoConfig.from_pretrained(path).vocab_size)
        ok, _ = check(args, path, cal, prompts)
    print(f"tp_check: {time.monotonic() - started:.0f} s in all")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
