"""Where a decode step's device time goes: the kernels of its CUDA graph in order, with each
one's share of the critical path.

    python bench/probes/decode_timeline.py                     # Qwen3-30B-A3B, batch 1 x 1024
    python bench/probes/decode_timeline.py --model llama3-8b --batch 8 --first 40

The engine is built as bench.engine builds it (random bf16 weights, decode CUDA graphs), with
`--batch` requests holding `--context` tokens of KV; `--replays` replays of the decode graph
are recorded with torch.profiler, which reports every kernel node of a replay. With
programmatic dependent launch a kernel starts while the one before it still runs, so its
duration overstates what it costs the step. The `chain` column is what it does cost: its end
minus the latest end of the kernels before it (0 if it ends earlier), so a replay's chain
values add up to the replay's span. A step's input copies run before its graph, outside it:
the host's time between them and the graph's first kernel lands in that kernel's chain.
Printed: per kernel name, launches per step, mean duration and chain per launch and chain per
step; then `--window` kernels of a replay in the middle,
from kernel `--first` on, in launch order (start relative to the replay's first kernel).
"""
from __future__ import annotations

import argparse
import collections
import re
import statistics
import tempfile
from pathlib import Path

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b", help="a bench.engine_models name")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--first", type=int, default=180, help="first kernel of the printed window")
    p.add_argument("--window", type=int, default=20)
    return p.parse_args(argv)


def short_name(name: str) -> str:
    """A kernel's name without template arguments, namespaces and parameter lists."""
    name = name.replace("void ", "").replace("(anonymous namespace)::", "")
    name = re.sub(r"<.*", "", name).split("(")[0]
    return name.split("::")[-1][:48]


def _profile_replays(engine, args: argparse.Namespace):
    """torch.profiler over args.replays replays of the decode graph at args.batch sequences."""
    from torch.profiler import ProfilerActivity, profile

    from tandem.bench.engine import _install_prefilled

    if engine.runner.graphs is None:
        raise SystemExit("decode_timeline: this engine captured no decode graphs")
    for cache in engine.runner.kv_caches:
        for tensor in cache:
            tensor.uniform_(-1, 1)
    _install_prefilled(engine, args.batch, args.context, torch.Generator().manual_seed(0))
    for _ in range(3):
        engine.step()
    engine.wait_in_flight()
    inputs = engine.runner.prepare_inputs(engine.scheduler.schedule())
    for _ in range(5):
        engine.runner.execute(inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.replays):
            engine.runner.execute(inputs)
        torch.cuda.synchronize()
    return prof


def record(args: argparse.Namespace) -> list[list[tuple[str, float, float]]]:
    """Per replay, its kernels as (name, start us, end us), in start order."""
    from tandem.bench.engine import build_engine
    from tandem.bench.engine_models import write_model_dir

    engine_args = argparse.Namespace(
        batches=[args.batch], contexts=[args.context], steps=8, prefill=[],
        kernels="aiter-triton", gpu_memory_utilization=0.9, async_scheduling=None)
    with tempfile.TemporaryDirectory() as root:
        engine = build_engine(write_model_dir(args.model, Path(root)), engine_args)
        try:
            prof = _profile_replays(engine, args)
        finally:
            engine.shutdown()
    kernels = sorted(((short_name(e.name), e.time_range.start, e.time_range.end)
                      for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda k: k[1])
    per = len(kernels) // args.replays
    return [kernels[i * per:(i + 1) * per] for i in range(args.replays)]


def with_chain(replay: list[tuple[str, float, float]]) -> list[tuple[str, float, float, float]]:
    """(name, start, duration, chain) per kernel; chain = end - latest earlier end, >= 0."""
    rows, latest = [], replay[0][1]
    for name, start, end in replay:
        rows.append((name, start, end - start, max(0.0, end - latest)))
        latest = max(latest, end)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    replays = [with_chain(r) for r in record(args)]
    span = statistics.median(sum(row[3] for row in r) for r in replays)
    print(f"{args.model}, batch {args.batch} x {args.context}: {len(replays[0])} kernels and "
          f"{span:.0f} us per replay (median of {len(replays)})")
    stats = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for replay in replays:
        for name, _, duration, chain in replay:
            stats[name][0] += 1
            stats[name][1] += duration
            stats[name][2] += chain
    print(f"{'kernel':<48} {'per step':>8} {'us each':>8} {'chain each':>10} {'chain/step':>10}")
    for name, (count, duration, chain) in sorted(stats.items(), key=lambda kv: -kv[1][2]):
        print(f"{name:<48} {count / len(replays):8.1f} {duration / count:8.2f} "
              f"{chain / count:10.2f} {chain / len(replays):10.1f}")
    middle = replays[len(replays) // 2]
    t0 = middle[0][1]
    print(f"\nkernels {args.first}..{args.first + args.window - 1} of one replay "
          f"(us: start, duration, chain)")
    for name, start, duration, chain in middle[args.first:args.first + args.window]:
        print(f"{start - t0:9.1f} {duration:7.2f} {chain:7.2f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
