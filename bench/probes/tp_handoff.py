"""KV handoff between tensor-parallel workers, by backend: the gap it leaves in a stream.

    python bench/probes/tp_handoff.py [--tp 2] [--backends grpc,cuda-ipc] [--prompts 1000,4000]

One stack per backend: a router, a prefill worker and a decode worker, both TP=--tp over the
same --tp GPUs (rank r of each on cuda:r), 8B-shaped bf16 random weights (load-format dummy),
prefix caching off. The prefill worker streams a request's first token; the decode worker
pulls the prompt's KV from every prefill rank, then decodes. So the handoff shows as the gap
between a stream's first and second token (router hop + pull + one decode step), and the
backends differ by their pull alone. Per prompt length, --requests sequential requests of
fresh random token ids (2 output tokens); the table gives the median TTFT and median gap, and
the KV bytes one prompt moves (layers x 2 x KV heads x head dim x 2 bytes per token).

--background keeps one more stream decoding on the decode worker throughout (a 16-token prompt,
--background-tokens tokens): its median gap between tokens (its TPOT), and per prompt length
the median over requests of its longest gap inside a handoff (from the handoff request's first
token to its second). A handoff that holds the decode worker's engine thread shows there as a
gap as long as the pull; one that lets steps go on leaves about one step.

TTFT parts: the router's own split of each request's TTFT (`tandem:time_to_first_token_part_
seconds`: router queue, prefill queue, prefill compute -- first scheduled to first token on the
prefill worker -- and first-token delivery), their means over the timed requests of a length.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from tandem.bench.disagg_stack import LocalStack, StackFailure, write_tokenizer
from tandem.bench.engine_models import write_model_dir
from tandem.bench.metrics_scrape import scrape
from tandem.client import TandemClient


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/probes/tp_handoff.py")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--backends", default="grpc,cuda-ipc")
    p.add_argument("--prompts", default="1000,4000", help="prompt lengths in tokens")
    p.add_argument("--requests", type=int, default=8, help="per prompt length (1 more warms)")
    p.add_argument("--log-dir", type=Path, help="keep the workers' logs here")
    p.add_argument("--background", action="store_true",
                   help="time a stream decoding beside the handoffs (see above)")
    p.add_argument("--background-tokens", type=int, default=6000)
    p.add_argument("--router-processes", type=int, metavar="N",
                   help="`tandem router --processes N` (default: the router's own default)")
    p.add_argument("--routing", help="`tandem router --routing` (default: the router's own)")
    return p.parse_args(argv)


def kv_bytes_per_token(model_dir: Path) -> int:
    from tandem.workers.models.loader import load_hf_config

    config = load_hf_config(model_dir)
    head_dim = getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 2


def router_args(args) -> list[str]:
    flags = []
    if args.router_processes is not None:
        flags += ["--processes", str(args.router_processes)]
    if args.routing is not None:
        flags += ["--routing", args.routing]
    return flags


TTFT_PARTS = ("router_queue", "prefill_queue", "prefill_compute", "first_token_delivery")
TTFT_PART_METRIC = "tandem:time_to_first_token_part_seconds"


def ttft_part_totals(metrics_address: str) -> dict[str, tuple[float, float]]:
    """(seconds, requests) per TTFT part, summed over the router's histogram so far."""
    totals = {part: (0.0, 0.0) for part in TTFT_PARTS}
    for sample in scrape(metrics_address):
        part = sample.labels.get("part")
        if part in totals and sample.name in (TTFT_PART_METRIC + "_sum",
                                               TTFT_PART_METRIC + "_count"):
            seconds, count = totals[part]
            totals[part] = ((seconds + sample.value, count) if sample.name.endswith("_sum")
                            else (seconds, count + sample.value))
    return totals


def mean_parts(before: dict, after: dict) -> dict[str, float]:
    """Each part's mean seconds over the requests observed between two totals."""
    return {part: (after[part][0] - before[part][0]) / max(1.0, after[part][1] - before[part][1])
            for part in TTFT_PARTS}


def one_request(client: TandemClient, prompt: list[int]) -> tuple[float, float, float]:
    """(start, first token, second token), perf_counter seconds."""
    started = time.perf_counter()
    times = []
    with client.stream(prompt, max_tokens=2, min_tokens=2, temperature=0.0) as stream:
        for delta in stream:
            times += [time.perf_counter()] * len(delta.token_ids)
    if len(times) < 2:
        raise RuntimeError(f"expected 2 tokens, got {len(times)}")
    return started, times[0], times[1]


class BackgroundStream:
    """One long greedy stream, read on its own thread: when each of its tokens arrived."""

    def __init__(self, client: TandemClient, prompt: list[int], max_tokens: int) -> None:
        self.times: list[float] = []
        self._stream = client.stream(prompt, max_tokens=max_tokens, min_tokens=max_tokens,
                                     temperature=0.0)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for delta in self._stream:
                self.times += [time.perf_counter()] * len(delta.token_ids)
        except Exception:  # cancelled by stop()
            pass

    def wait_for_tokens(self, count: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.times) < count:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the background stream gave {len(self.times)} tokens")
            time.sleep(0.01)

    def wait_past(self, moment: float, timeout: float = 10.0) -> None:
        """Until a token arrived after `moment` (so the gap spanning it is known), the stream
        ended or `timeout` passed."""
        deadline = time.monotonic() + timeout
        while (not self.times or self.times[-1] < moment) and self._thread.is_alive() \
                and time.monotonic() < deadline:
            time.sleep(0.005)

    def stop(self) -> None:
        self._stream.cancel()
        self._thread.join(30)

    def median_gap(self) -> float:
        return statistics.median(b - a for a, b in zip(self.times, self.times[1:]))

    def longest_gap(self, start: float, end: float) -> float:
        """The longest gap between two of its tokens that overlaps [start, end]; NaN when
        the stream had ended by then."""
        gaps = [b - a for a, b in zip(self.times, self.times[1:]) if b > start and a < end]
        return max(gaps) if gaps and self.times[-1] >= end else float("nan")


def run_backend(backend: str, args, model_dir: Path, log_dir: Path, vocab: int) -> dict:
    stack = LocalStack(f"tp{args.tp}-{backend}", model_dir,
                       [("prefill", "cuda"), ("decode", "cuda")], log_dir,
                       worker_args=["--tensor-parallel-size", str(args.tp), "--kv-transfer",
                                    backend, "--load-format", "dummy", "--dtype", "bfloat16",
                                    "--no-prefix-caching", "--max-num-seqs", "8",
                                    "--max-model-len", "8192",
                                    "--gpu-memory-utilization", "0.45"],  # the two share GPUs
                       router_args=router_args(args))
    rng = random.Random(7)
    rows = {}
    address = stack.start()
    try:
        client = TandemClient(address, timeout=600)
        background = None
        if args.background:
            background = BackgroundStream(client, [rng.randrange(vocab) for _ in range(16)],
                                          args.background_tokens)
            background.wait_for_tokens(20)
        for length in (int(n) for n in args.prompts.split(",")):
            one_request(client, [rng.randrange(vocab) for _ in range(length)])  # warm-up
            before = ttft_part_totals(stack.metrics_address)
            samples = [one_request(client, [rng.randrange(vocab) for _ in range(length)])
                       for _ in range(args.requests)]
            parts = mean_parts(before, ttft_part_totals(stack.metrics_address))
            stall = float("nan")
            if background:
                background.wait_past(samples[-1][2])  # the last handoff's gap, complete
                stalls = [background.longest_gap(first, second) for _, first, second in samples]
                stall = statistics.median(stalls)
                print(f"{backend}: {length}-token prompts: the background stream's longest gap "
                      f"per handoff, ms: {' '.join(f'{s * 1e3:.1f}' for s in stalls)}")
            rows[length] = (statistics.median(first - start for start, first, _ in samples),
                            statistics.median(second - first for _, first, second in samples),
                            stall, parts)
            print(f"{backend}: {length}-token prompts done", flush=True)
        if background:
            background.stop()
            rows["background_tpot"] = background.median_gap()
    finally:
        stack.stop()
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if torch.cuda.device_count() < args.tp:
        print(f"tp_handoff: needs {args.tp} GPUs", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as root:
        model_dir = write_model_dir(args.model, Path(root))
        write_tokenizer(model_dir)
        per_token = kv_bytes_per_token(model_dir)
        log_dir = args.log_dir or Path(root)
        log_dir.mkdir(parents=True, exist_ok=True)
        results = {}
        for backend in args.backends.split(","):
            try:
                results[backend] = run_backend(backend, args, model_dir, log_dir, 256)
            except StackFailure as exc:
                print(f"{backend}: {exc}", file=sys.stderr)
                return 1
    print(f"\n{args.model}, TP={args.tp} prefill -> TP={args.tp} decode on the same "
          f"{args.tp} GPUs; medians of {args.requests} requests")
    print(f"{'prompt':>7} {'KV MiB':>7} " + " ".join(
        f"{b + ' TTFT ms':>18} {b + ' gap ms':>17}" for b in results))
    for length in (int(n) for n in args.prompts.split(",")):
        cells = " ".join(f"{results[b][length][0] * 1e3:18.1f} {results[b][length][1] * 1e3:17.1f}"
                         for b in results)
        print(f"{length:>7} {length * per_token / 2**20:7.0f} {cells}")
    print("\nTTFT parts as the router splits them, mean ms over the timed requests")
    print(f"{'backend':>10} {'prompt':>7} " + " ".join(f"{part:>20}" for part in TTFT_PARTS))
    for b, rows in results.items():
        for n in args.prompts.split(","):
            print(f"{b:>10} {n:>7} " + " ".join(f"{rows[int(n)][3][part] * 1e3:20.1f}"
                                                 for part in TTFT_PARTS))
    if args.background:
        print("\nthe background stream: its median gap (TPOT) and, per prompt length, the "
              "median over handoffs of its longest gap during one, ms")
        print(f"{'backend':>10} {'TPOT':>7} " + " ".join(
            f"{f'stall @{n}':>11}" for n in args.prompts.split(",")))
        for b, rows in results.items():
            print(f"{b:>10} {rows['background_tpot'] * 1e3:7.1f} " + " ".join(
                f"{rows[int(n)][2] * 1e3:11.1f}" for n in args.prompts.split(",")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
