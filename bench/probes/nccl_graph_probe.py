"""Which part of capturing NCCL collectives into CUDA graphs hangs? A 2-GPU probe, stage by stage.

    NCCL_DEBUG=WARN python bench/probes/nccl_graph_probe.py [--eager-init] [--stages a,b]

Like the TP engine, each rank (a child process; the parent holds the TCPStore on 127.0.0.1, port
chosen by the OS) does set_device(rank), init_process_group("nccl", store=, rank=, world_size=)
(with device_id=cuda:rank under --eager-init: communicator made at init, not at first use) and a
gloo group, used for a barrier before every stage. Stages (stage "init" always runs first):
  eager_all_reduce                warm the communicator eagerly, check the sum
  capture_all_reduce              captured on torch.cuda.graph's own side stream, replayed, checked
  capture_all_gather_into_tensor  the same
  capture_all_gather_list         the same, list form dist.all_gather(list, t)   (suspect 1)
  capture_many                    3 graphs (batch 4, 2, 1; one pool, one side stream), each matmul
                                  + all_reduce + list all_gather, checked against eager
                                                                                 (suspect 4)
  fresh_comm_capture              new_group(backend="nccl") whose FIRST collective is captured:
                                  expected to fail or hang (suspect 2; under --eager-init the new
                                  group may be set up eagerly, so then it is not really fresh)
Suspect 3 (ProcessGroupNCCL's watchdog querying events mid-capture): compare --capture-error-mode
global (the default) with thread_local / relaxed, and TORCH_NCCL_ENABLE_MONITORING=0 in the env.
Children print "rank R stage S start|ok <ms> ms|error <msg>"; a watchdog thread prints "rank R HANG
S" (S ending ":barrier": the peer is gone), dumps Python stacks and exits 3 after --stage-timeout.
The parent kills both after --timeout, prints a stage x rank table, writes everything to
$OUT/nccl-graph-probe.log if OUT is set, and exits 0 whatever happened: it is a probe.

Found on 2 H200s (bench/RESULTS.md): every stage but fresh_comm_capture
passes, so capturing the engine's collectives was never the problem; the TP engine's hang was
rank 0's destroy_process_group waiting on the live graphs (LLMEngine.shutdown frees them first).
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import re
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

WORLD, N = 2, 1024  # ranks; elements per rank in the small collectives
STAGES = ["eager_all_reduce", "capture_all_reduce", "capture_all_gather_into_tensor",
          "capture_all_gather_list", "capture_many", "fresh_comm_capture"]


def _capture(a, fn, pool=None, stream=None):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool, stream=stream, capture_error_mode=a.capture_error_mode):
        out = fn()
    return g, out


def _all_reduce(x, group=None):
    dist.all_reduce(y := x.clone(), group=group)
    return y


def _ag_list(x):
    outs = [x.new_empty(x.shape) for _ in range(WORLD)]
    dist.all_gather(outs, x)
    return outs


def _ag_tensor(x):
    dist.all_gather_into_tensor(out := x.new_empty(WORLD * N), x)
    return out.view(WORLD, N)


def _graph_stage(c, body, gather=False):
    """Capture body(x) on a static x = rank+1, replay with x = rank+1+i and check every result:
    a reduction must equal sum_r (r+1+i), row r of a gather r+1+i."""
    x = torch.full((N,), float(c.rank + 1), device=c.dev)
    g, out = _capture(c.a, lambda: body(x))
    rows = torch.arange(WORLD, device=c.dev, dtype=torch.float32)[:, None].expand(WORLD, N)
    for i in range(c.a.replays):
        x.fill_(c.rank + 1 + i)
        g.replay()
        torch.cuda.synchronize()
        want = rows + 1 + i if gather else torch.full_like(x, WORLD * (WORLD + 1) / 2 + WORLD * i)
        got = torch.stack(out) if isinstance(out, list) else out
        if not torch.equal(got, want):
            raise AssertionError(f"replay {i}: got {got.flatten()[::N].tolist()}")


def stage_eager_all_reduce(c):
    # The first use creates the communicator (without --eager-init).
    dist.all_reduce(torch.ones(N, device=c.dev))
    y = _all_reduce(torch.full((N,), float(c.rank + 1), device=c.dev))
    if not (y == WORLD * (WORLD + 1) / 2).all().item():
        raise AssertionError(f"sum {y[0].item()}")


def stage_capture_many(c):
    H, V = 256, 512  # hidden size, this rank's vocabulary shard
    gen = torch.Generator(device=c.dev).manual_seed(1234 + c.rank)
    w, wl = (torch.randn(H, k, device=c.dev, generator=gen) / H ** 0.5 for k in (H, V))

    def fwd(x):
        h = x @ w
        dist.all_reduce(h)  # row-parallel linear
        return torch.cat(_ag_list((h @ wl).contiguous()), dim=1)  # vocab-parallel LM head

    pool, side, graphs = torch.cuda.graph_pool_handle(), torch.cuda.Stream(), {}
    xs = {b: torch.randn(b, H, device=c.dev, generator=gen) for b in (4, 2, 1)}  # largest first
    for b, x in xs.items():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fwd(x)  # eager warm-up on the capture stream, as engines do
        torch.cuda.current_stream().wait_stream(side)
        graphs[b] = _capture(c.a, lambda: fwd(x), pool=pool, stream=side)
    for b, (g, out) in graphs.items():
        for i in range(3):
            xs[b].copy_(torch.randn(b, H, device=c.dev, generator=gen))
            g.replay()
            ref = fwd(xs[b])
            if not torch.allclose(out, ref, rtol=1e-3, atol=1e-3):
                diff = (out - ref).abs().max().item()
                raise AssertionError(f"batch {b} replay {i}: max diff {diff}")


def stage_fresh_comm_capture(c):
    grp = dist.new_group(backend="nccl")  # called on every rank, outside the capture
    _graph_stage(c, lambda x: _all_reduce(x, grp))


STAGE_FNS = {
    "eager_all_reduce": stage_eager_all_reduce,
    "capture_all_reduce": lambda c: _graph_stage(c, _all_reduce),
    "capture_all_gather_into_tensor": lambda c: _graph_stage(c, _ag_tensor, gather=True),
    "capture_all_gather_list": lambda c: _graph_stage(c, _ag_list, gather=True),
    "capture_many": stage_capture_many,
    "fresh_comm_capture": stage_fresh_comm_capture,
}


def child(a):
    r, now = a.rank, {"stage": None, "t0": 0.0}
    c = argparse.Namespace(a=a, rank=r, dev=torch.device("cuda", r))
    say = lambda msg: print(f"rank {r} {msg}", flush=True)  # noqa: E731

    def phase(name):  # arm the watchdog; faulthandler is the backstop should the GIL be stuck
        now["t0"], now["stage"] = time.monotonic(), name
        faulthandler.dump_traceback_later(a.stage_timeout + 10, exit=True)

    def watchdog():
        while not (now["stage"] and time.monotonic() - now["t0"] > a.stage_timeout):
            time.sleep(0.2)
        say(f"HANG {now['stage']} after {a.stage_timeout:g}s; Python stacks:")
        faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
        sys.stdout.flush()
        os._exit(3)

    def init():
        torch.cuda.set_device(r)
        say(f"device {torch.cuda.get_device_name(r)}")
        store = dist.TCPStore("127.0.0.1", a.port, is_master=False, timeout=timedelta(seconds=60))
        kw = {"device_id": c.dev} if a.eager_init else {}
        dist.init_process_group("nccl", store=store, rank=r, world_size=WORLD, **kw)
        c.ctl = dist.new_group(backend="gloo")  # control group, as in the engine

    def run(name, fn):
        say(f"stage {name} start")
        t = time.perf_counter()
        try:
            fn()
            torch.cuda.synchronize()
            return say(f"stage {name} ok {(time.perf_counter() - t) * 1e3:.1f} ms") or True
        except Exception as e:  # report and go on; later stages may inherit a broken context
            say(f"stage {name} error {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")

    threading.Thread(target=watchdog, daemon=True).start()
    phase("init")
    if not run("init", init):
        os._exit(2)
    for name in a.stages.split(","):
        phase(f"{name}:barrier")
        dist.barrier(group=c.ctl)
        phase(name)
        run(name, lambda: STAGE_FNS[name](c))
    now["stage"] = None
    faulthandler.cancel_dump_traceback_later()
    say("done")
    os._exit(0)  # skip process-group teardown, which can itself hang after a failed capture


def parent(a):
    header = [f"torch {torch.__version__} cuda {torch.version.cuda} "
              f"devices {torch.cuda.device_count()}"]
    if torch.cuda.device_count() < WORLD or not dist.is_nccl_available():
        print(f"SKIP: nccl_graph_probe needs {WORLD} CUDA devices and NCCL ({header[0]})")
        return 0
    env = sorted(f"{k}={v}" for k, v in os.environ.items()
                 if k.startswith(("NCCL_", "TORCH_NCCL_")))
    header += [f"nccl {torch.cuda.nccl.version()} args {' '.join(sys.argv[1:]) or '(defaults)'}",
               "env " + (" ".join(env) or "(no NCCL_* / TORCH_NCCL_* set)")]
    print("\n".join(header), flush=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    lines, procs, readers = [], [], []
    for r in range(WORLD):
        cmd = [sys.executable, os.path.abspath(__file__), "--rank", str(r),
               "--port", str(store.port), "--stages", a.stages,
               "--stage-timeout", str(a.stage_timeout), "--replays", str(a.replays),
               "--capture-error-mode", a.capture_error_mode] + ["--eager-init"] * a.eager_init
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True,
                                      bufsize=1, env={**os.environ, "PYTHONUNBUFFERED": "1"}))

        def read(p=procs[-1], r=r):
            for ln in p.stdout:
                lines.append((r, ln.rstrip("\n")))
                print(f"[r{r}] {ln}", end="", flush=True)

        readers.append(threading.Thread(target=read, daemon=True))
        readers[-1].start()
    deadline, killed = time.monotonic() + a.timeout, False
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p, t in zip(procs, readers):
        if p.poll() is None:
            p.kill()
            killed = True
        p.wait()
        t.join(timeout=5)
    status = {}
    for _, ln in lines:
        if m := re.match(r"rank (\d+) stage (\S+) (start|ok|error)\s*(.*)", ln):
            status[int(m[1]), m[2]] = "started" if m[3] == "start" else f"{m[3]} {m[4]}"[:40]
        elif m := re.match(r"rank (\d+) HANG (\S+)", ln):
            stage, _, where = m[2].partition(":")
            status[int(m[1]), stage] = "HANG (in barrier: peer gone?)" if where else "HANG"
    for (r, s), v in status.items():
        if v == "started":  # no verdict: killed at --timeout, or died (faulthandler exit, crash)
            status[r, s] = "killed (--timeout)" if killed else f"died rc={procs[r].returncode}"
    rows = [("stage", [f"rank {r}" for r in range(WORLD)])]
    rows += [(s, [status.get((r, s), "-") for r in range(WORLD)])
             for s in ["init"] + a.stages.split(",")]
    table = [(f"{s:32}" + "".join(f"{v:42}" for v in vs)).rstrip() for s, vs in rows]
    table.append("exit codes " + " ".join(str(p.returncode) for p in procs) + " (killed)" * killed)
    print("\n".join(table), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "nccl-graph-probe.log"), "w") as f:
            f.write("\n".join(header + [f"[r{r}] {ln}" for r, ln in lines] + table) + "\n")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", default=",".join(STAGES),
                    help="comma-separated, of: " + ", ".join(STAGES))
    ap.add_argument("--stage-timeout", type=float, default=20.0,
                    help="seconds per stage before HANG")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds for the whole run")
    ap.add_argument("--eager-init", action="store_true",
                    help="init_process_group(device_id=cuda:rank)")
    ap.add_argument("--capture-error-mode", default="global",
                    choices=["global", "thread_local", "relaxed"])
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # set for the child processes
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if bad := [s for s in a.stages.split(",") if s not in STAGE_FNS]:
        ap.error(f"unknown stages {bad}")
    return child(a) if a.rank is not None else parent(a)


if __name__ == "__main__":
    sys.exit(main())
