"""The engine against the device's limits, in one run on one GPU.

    python -m tandem.bench.engine --out results.json            # everything (about 5-8 min)
    python -m tandem.bench.engine --models qwen3-30b-a3b --no-ops --no-hf
    python -m tandem.bench.engine --models deepseek-v3-slice --no-ops   # 74 GB of weights: an H200,
        # or an 80 GB H100 with --gpu-memory-utilization 0.95

Order: measure copy bandwidth and the bf16 matmul rate; time the aiter-triton ops against their
alternatives; then per model (random bf16 weights made on the GPU): decode steps at each batch
x context (KV of prefilled requests installed the way a decode worker receives them), prefill
of one prompt per length, and for llama3-8b the same batch-1 decode through HF transformers.

Reported per decode case: `model step` (one CUDA-graph replay, embedding to logits, timed with
CUDA events) as a ratio to its floor = (weights + chosen experts + KV read) / copy bandwidth;
`engine step` (LLMEngine.step() calls back to back, wall time per call: schedule, inputs,
replay, sampling, token handling; asynchronous scheduling overlaps the host part with the
previous step's replay when the engine has it on); `queued` (the model step's replay, ten
queued back to back: the device's time per step without the host's latency in starting a
lone replay) and its ratio to the floor. Prefill: the step's time against FLOPs / matmul
rate. The table is printed last; --out keeps the JSON.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tandem.bench.engine_limits import DeviceLimits, measure_limits, shape_of, time_cuda
from tandem.bench.engine_models import MODELS, write_model_dir
from tandem.common.sampling_params import SamplingParams


def build_engine(model_dir: Path, args: argparse.Namespace):
    """An LLMEngine on random bf16 weights sized for the decode cases and prefill lengths of
    `args` (batches, contexts, steps, prefill, kernels, gpu_memory_utilization)."""
    from tandem.workers.engine.config import EngineConfig
    from tandem.workers.engine.engine import LLMEngine
    from tandem.workers.executor.executor import build_executor

    # Decode cases reach max(contexts) + steps + 5 tokens; two blocks (of 16) past that leave
    # each sequence a free KV block, without which asynchronous scheduling queues no step
    # ahead (engine._can_launch_ahead) and the engine steps alternate queue and read.
    max_len = max(max(args.contexts) + args.steps + 8 + 32, max(args.prefill, default=0) + 8)
    config = EngineConfig(
        model=str(model_dir), dtype="bfloat16", load_format="dummy", kernels=args.kernels,
        max_model_len=max_len, max_num_seqs=max(args.batches),
        max_num_batched_tokens=max(args.prefill, default=2048),
        gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False,
        async_scheduling=getattr(args, "async_scheduling", None))
    return LLMEngine(config, build_executor(config))


def _install_prefilled(engine, batch: int, context: int, gen: torch.Generator) -> list[str]:
    """batch requests whose first `context` tokens' KV is in place (random values)."""
    vocab = engine.resolved.vocab_size
    ids = []
    for i in range(batch):
        prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
        params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
        seq = engine.reserve_prefilled(prompt, [1], params, f"decode-{batch}-{context}-{i}")
        if seq is None:
            raise RuntimeError("KV blocks ran out")
        engine.activate_prefilled(seq, context)
        ids.append(seq.request_id)
    return ids


def _experts_read(engine, inputs) -> int:
    """Distinct routed experts chosen in this step, summed over MoE layers (one eager pass, on
    the general path: the decode kernels route on the device, where no hook sees the ids)."""
    from tandem.workers.ops.moe import FusedMoE

    counts: list[int] = []
    layers = [m for m in engine.model.modules() if isinstance(m, FusedMoE)]
    hooks = [m.register_forward_pre_hook(
        lambda _m, a: counts.append(int(torch.unique(a[2]).numel()))) for m in layers]
    decode_max_pairs = [m.decode_max_pairs for m in layers]
    try:
        for m in layers:
            m.decode_max_pairs = 0
        with torch.inference_mode():
            engine.model(inputs.input_ids, inputs.positions, inputs.meta)
    finally:
        for hook, m, saved in zip(hooks, layers, decode_max_pairs):
            hook.remove()
            m.decode_max_pairs = saved
    return sum(counts)


def profile_step(engine, inputs, top: int = 14) -> str:
    """Kernel time table of one eager forward of the same decode inputs (torch.profiler): the
    graph replays the same kernels, so step time minus their sum is launch gaps."""
    from torch.profiler import ProfilerActivity, profile

    def forward():
        hidden = engine.model(inputs.input_ids, inputs.positions, inputs.meta)
        return engine.model.compute_logits(hidden)

    with torch.inference_mode():
        forward()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            forward()
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=top,
                                     max_name_column_width=70)


def bench_decode(engine, shape, limits: DeviceLimits, batch: int, context: int,
                 steps: int, profile: bool = False) -> dict:
    blocks = batch * -(-(context + steps + 5) // engine.config.block_size)
    if blocks > engine.block_manager.num_free_blocks:
        return {"skipped": f"needs {blocks} KV blocks, {engine.block_manager.num_free_blocks} "
                           "fit in this GPU's memory"}
    ids = _install_prefilled(engine, batch, context, torch.Generator().manual_seed(batch))
    try:
        for _ in range(2):  # graphs warm; under asynchronous scheduling a step is queued
            engine.step()
        # Whole engine steps back to back, as a serving engine runs them: each call reads one
        # step's tokens (and, asynchronously scheduled, has queued the next one first). A call
        # that only queues a step returns no tokens, so the time is per step whose tokens came
        # back (each gives every one of the batch's sequences a token), not per call.
        torch.cuda.synchronize()
        started = time.perf_counter()
        tokens = sum(len(engine.step()) for _ in range(steps))
        torch.cuda.synchronize()
        engine_s = (time.perf_counter() - started) / max(1, tokens // batch)
        engine.wait_in_flight()
        inputs = engine.runner.prepare_inputs(engine.scheduler.schedule())
        model_s = time_cuda(lambda: engine.runner.execute(inputs))
        queued_s = time_cuda(lambda: engine.runner.execute(inputs), reps=5, calls=10)
        experts = _experts_read(engine, inputs) if shape.num_moe_layers else 0
        table = profile_step(engine, inputs) if profile else None
    finally:
        for request_id in ids:
            engine.abort(request_id)
    ctx = context + steps + 4  # keys read by the timed step
    floor_bytes = shape.decode_bytes(batch, ctx, experts)
    floor_s = floor_bytes / limits.copy_bytes_per_s
    return {"model_step_ms": model_s * 1e3, "queued_step_ms": queued_s * 1e3,
            "engine_step_ms": engine_s * 1e3, "floor_ms": floor_s * 1e3,
            "ratio": model_s / floor_s, "queued_ratio": queued_s / floor_s,
            "bytes_read_GB": floor_bytes / 1e9, "experts_read": experts,
            "graphed": engine.runner.graphs is not None, **({"profile": table} if table else {})}


def bench_prefill(engine, shape, limits: DeviceLimits, length: int, reps: int = 3,
                  profile: bool = False) -> dict:
    """One engine step prefilling one prompt of `length` random tokens (median of reps after
    a warm-up); with profile, the kernel time table of one more such step."""
    gen = torch.Generator().manual_seed(length)
    vocab = engine.resolved.vocab_size

    def prefill_step() -> float:
        prompt = torch.randint(0, vocab, (length,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        torch.cuda.synchronize()
        started = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        return time.perf_counter() - started

    prefill_step()  # warm-up
    seconds = statistics.median([prefill_step() for _ in range(reps)])
    flops = shape.prefill_flops(length)
    row = {"ms": seconds * 1e3, "TFLOPs": flops / seconds / 1e12,
           "floor_ms": flops / limits.matmul_flops_per_s * 1e3,
           "matmul_fraction": flops / seconds / limits.matmul_flops_per_s}
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            prefill_step()
        row["profile"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=16,
                                                   max_name_column_width=70)
    return row


def bench_hf_decode(model_dir: Path, context: int, steps: int = 12) -> float:
    """HF transformers' eager decode step (SDPA, dynamic cache) at batch 1: median seconds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (1, context), device="cuda")
    times = []
    with torch.no_grad():
        out = model(ids, use_cache=True)
        for _ in range(steps):
            nxt = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            started = time.perf_counter()
            out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
    del model, out
    return statistics.median(times[2:])


def in_child(function, *args):
    """function(*args) in a fresh spawned process: its GPU memory (CUDA context, graph pools,
    the caching allocator) is given back entirely when it returns, which dropping an engine in
    this process does not do."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(function, args)


def bench_model(name: str, root: Path, limits: DeviceLimits, args) -> dict:
    model_dir = write_model_dir(name, root)
    engine = build_engine(model_dir, args)
    top_k = getattr(engine.hf_config, "num_experts_per_tok", 0)
    shape = shape_of(engine.model, engine.hf_config, top_k)
    for cache in engine.runner.kv_caches:
        for tensor in cache:
            tensor.uniform_(-1, 1)  # random KV: never time on zeros
    result: dict = {"weights_GB": shape.dense_weight_bytes / 1e9, "decode": {}, "prefill": {}}
    for context in args.contexts:
        for batch in args.batches:
            profile = args.profile and (batch, context) in ((1, min(args.contexts)),
                                                            (max(args.batches), min(args.contexts)))
            row = bench_decode(engine, shape, limits, batch, context, args.steps, profile)
            result["decode"][f"{batch}x{context}"] = row
            print(f"  {name} decode {batch}x{context}: " + json.dumps(
                {k: v for k, v in row.items() if k != "profile"}), flush=True)
            if "profile" in row:
                print(row["profile"], flush=True)
    from tandem.workers.ops.gpu import fa4_prefill
    graphs = getattr(engine.runner, "prefill_graphs", None)
    for length in args.prefill:
        launches = fa4_prefill.num_calls
        replays = graphs.num_replays if graphs is not None else 0
        row = bench_prefill(engine, shape, limits, length,
                            profile=args.profile and length == max(args.prefill))
        # which attention the prompt ran (runs with and without flash-attn-4 differ), and
        # whether its steps replayed a prefill CUDA graph (workers/engine/prefill_graphs.py)
        ran_fa4 = fa4_prefill.num_calls > launches
        row["attention"] = f"FlashAttention-4, {fa4_prefill.fa4_in_use(torch.device('cuda'))}" \
            if ran_fa4 else "torch SDPA"
        row["prefill_graph"] = graphs is not None and graphs.num_replays > replays
        result["prefill"][str(length)] = row
        print(f"  {name} prefill {length}: " + json.dumps(
            {k: v for k, v in row.items() if k != "profile"}), flush=True)
        if "profile" in row:
            print(row["profile"], flush=True)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    if name == "llama3-8b" and not args.no_hf:
        context = min(args.contexts)
        hf_s = bench_hf_decode(model_dir, context)
        floor_s = shape.decode_bytes(1, context, 0) / limits.copy_bytes_per_s
        result["hf_decode_bs1"] = {"context": context, "ms": hf_s * 1e3,
                                   "ratio": hf_s / floor_s}
        gc.collect()
        torch.cuda.empty_cache()
    return result


def format_table(results: dict) -> str:
    lim = results["limits"]
    lines = [f"{lim['device']}: copy {lim['copy_TBps']:.2f} TB/s, bf16 matmul "
             f"{lim['bf16_matmul_TFLOPs']:.0f} TFLOP/s, kernels={results['kernels']}"]
    for row in results.get("ops", []):
        frac = f"  {row['copy_fraction']:.0%} of copy BW" if "copy_fraction" in row else ""
        mark = "*" if row["chosen"] else " "
        lines.append(f"  op {mark} {row['op']:<28} {row['shape']:<24} {row['impl']:<34} "
                     f"{row['us']:8.1f} us{frac}")
    lines.append(f"{'model':<14} {'case':<18} {'model step':>11} {'floor':>9} {'ratio':>7} "
                 f"{'engine step':>12} {'queued':>9} {'ratio':>6}")
    for name, res in results["models"].items():
        for case, row in res["decode"].items():
            if "skipped" in row:
                lines.append(f"{name:<14} decode {case:<11} skipped: {row['skipped']}")
                continue
            lines.append(f"{name:<14} decode {case:<11} {row['model_step_ms']:8.2f} ms "
                         f"{row['floor_ms']:6.2f} ms {row['ratio']:6.2f}x "
                         f"{row['engine_step_ms']:9.2f} ms {row['queued_step_ms']:6.2f} ms "
                         f"{row['queued_ratio']:5.2f}x")
        for length, row in res["prefill"].items():
            lines.append(f"{name:<14} prefill {length:<10} {row['ms']:8.1f} ms "
                         f"{row['floor_ms']:6.1f} ms  {row['matmul_fraction']:.0%} of matmul "
                         f"rate ({row['TFLOPs']:.0f} TFLOP/s)"
                         + (f", attention: {row['attention']}" if "attention" in row else "")
                         + (", from a prefill CUDA graph" if row.get("prefill_graph") else ""))
        if "hf_decode_bs1" in res:
            hf = res["hf_decode_bs1"]
            lines.append(f"{name:<14} HF decode 1x{hf['context']:<6} {hf['ms']:8.2f} ms "
                         f"{'':>9} {hf['ratio']:6.2f}x  (transformers eager, same floor)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench.engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama3-8b,qwen3-30b-a3b",
                        help=f"comma-separated, from: {', '.join(MODELS)}")
    parser.add_argument("--batches", default="1,8,32,64,128")
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--prefill", default="2048,8192")
    parser.add_argument("--steps", type=int, default=8, help="engine steps timed per case")
    parser.add_argument("--kernels", default="aiter-triton")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="fraction of the GPU each engine may use (its KV cache gets what "
                             "the weights and activations leave)")
    parser.add_argument("--no-ops", action="store_true")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="print the kernel time tables of the smallest and largest batch and "
                             "of the longest prefill")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    for field in ("batches", "contexts", "prefill"):
        setattr(args, field, [int(v) for v in getattr(args, field).split(",") if v])
    if not torch.cuda.is_available():
        print("bench/engine.py needs a CUDA or ROCm GPU", file=sys.stderr)
        return 2
    limits = measure_limits()
    results: dict = {"limits": limits.as_dict(), "kernels": args.kernels, "models": {}}
    print(f"limits: {results['limits']}", flush=True)
    if not args.no_ops:
        from tandem.bench.engine_ops import op_rows
        results["ops"] = op_rows(limits)
    with tempfile.TemporaryDirectory() as root:
        for name in filter(None, args.models.split(",")):
            # each model in its own process: its GPU memory is all given back before the
            # next model is sized (dropping an engine here keeps graph pools and the cache)
            results["models"][name] = in_child(bench_model, name, Path(root), limits, args)
            if args.out:
                args.out.write_text(json.dumps(results, indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
