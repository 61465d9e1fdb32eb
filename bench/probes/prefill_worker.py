"""One prefill worker's own prefill time, as it reports it, for the code of any checkout.

    python bench/probes/prefill_worker.py [--tp 2] [--prompt-len 4000] [--requests 6]
        [--code DIR [DIR ...]] [--worker-arg=--flag ...]

Starts `tandem.workers.server --role prefill` on the llama3-8b shape with dummy weights (TP
ranks on cuda:0..tp-1; prefix caching off, so every prompt is computed whole) and sends it
--requests Prefill calls of fresh random prompts that keep their KV, as a router does. Each
reply's `compute_seconds` (first scheduled -> first token, measured by the worker) and the
call's wall time are printed; the table gives their medians after the first call.

--code runs the worker of other checkouts (each a source tree with a tandem/ package, e.g. a
`git archive` of an older commit with router/, workers/, common/ linked into tandem/), one
after the other, each as its own process with that tree first on its path: the way to place a
served prefill regression between two commits on one machine.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from tandem.bench.engine_models import write_model_dir
from tandem.common.convert import engine_params_to_proto
from tandem.common.ports import free_port
from tandem.common.sampling_params import SamplingParams
from tandem.v1 import worker_pb2, worker_pb2_grpc

START_TIMEOUT_S = 300.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/probes/prefill_worker.py")
    p.add_argument("--model", default="llama3-8b", help="a bench/engine_models.py shape")
    p.add_argument("--model-path", type=Path, help="a checkpoint folder instead (real weights)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=4000)
    p.add_argument("--requests", type=int, default=6, help="the first one is not counted")
    p.add_argument("--kv-transfer", default="cuda-ipc")
    p.add_argument("--code", nargs="+", type=Path, default=[None], metavar="DIR",
                   help="source trees whose worker runs (default: this one)")
    p.add_argument("--worker-arg", action="append", default=[],
                   help="one more worker flag (repeat; use the --worker-arg=--flag form)")
    p.add_argument("--log-dir", type=Path, help="keep the workers' logs here")
    args = p.parse_args(argv)
    if args.requests < 2:
        p.error("--requests must be at least 2 (the first is not counted)")
    return args


def start_worker(args, model_dir: Path, code: Path | None, log_path: Path):
    """(process, address): the worker of `code` (None: this checkout) in its own session."""
    port = free_port()
    env = dict(os.environ)
    cwd = None
    if code is not None:  # `python -m` puts the working directory first on the path
        env["PYTHONPATH"] = str(code)
        cwd = code
    argv = [sys.executable, "-m", "tandem.workers.server", "--role", "prefill", "--model",
            str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
            *([] if args.model_path else ["--load-format", "dummy"]),
            "--tensor-parallel-size", str(args.tp),
            "--no-prefix-caching", "--max-num-seqs", "8", "--max-model-len", "8192",
            "--kv-transfer", args.kv_transfer, *args.worker_arg]
    log = open(log_path, "w")
    process = subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)  # the follower ranks go with it
    return process, f"127.0.0.1:{port}"


def wait_serving(process, address: str, log_path: Path) -> worker_pb2_grpc.WorkerStub:
    stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(address))
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=2)
            return stub
        except grpc.RpcError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not start; its log: {log_path}") from None
            time.sleep(0.5)


def measure(args, model_dir: Path, code: Path | None, log_dir: Path) -> dict:
    name = "this checkout" if code is None else str(code)
    log_path = log_dir / f"prefill-worker-{len(list(log_dir.iterdir()))}.log"
    process, address = start_worker(args, model_dir, code, log_path)
    try:
        stub = wait_serving(process, address, log_path)
        params = engine_params_to_proto(SamplingParams(temperature=0, max_tokens=8))
        rng = random.Random(0)
        computes, walls = [], []
        for i in range(args.requests):
            prompt = [rng.randrange(1, 500) for _ in range(args.prompt_len)]
            started = time.perf_counter()
            reply = stub.Prefill(worker_pb2.PrefillRequest(
                request_id=f"probe-{i}", prompt_token_ids=prompt, params=params, keep_kv=True),
                timeout=120)
            walls.append(time.perf_counter() - started)
            computes.append(reply.compute_seconds)
        print(f"{name}: compute ms {' '.join(f'{c * 1e3:.1f}' for c in computes)}", flush=True)
        return {"code": name, "compute": statistics.median(computes[1:]),
                "wall": statistics.median(walls[1:])}
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        model_dir = args.model_path or write_model_dir(args.model, Path(root))
        log_dir = args.log_dir or Path(root) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        rows = [measure(args, model_dir, code, log_dir) for code in args.code]
    print(f"\n{args.model_path or args.model}, TP={args.tp} prefill worker, "
          f"{args.prompt_len}-token prompts; medians of {args.requests - 1} calls")
    print(f"{'code':<40} {'compute ms':>11} {'call ms':>9}")
    for row in rows:
        print(f"{row['code'][-40:]:<40} {row['compute'] * 1e3:11.1f} {row['wall'] * 1e3:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
