"""Run a function as the ranks of a real multi-process group, for protocol tests."""
from __future__ import annotations

import json
import multiprocessing
from collections.abc import Callable
from pathlib import Path


def run_ranks(rank_main: Callable[[int, str, str], None], tmp_path: Path, world: int,
              timeout: float = 120.0) -> list[dict]:
    """Runs rank_main(rank, init_file, out_path) in `world` spawned processes (init_file: a
    file:// rendezvous path in tmp_path; out_path: where the rank writes its JSON results).
    Asserts every rank exited 0 within `timeout` seconds (one still running is killed) and
    returns the results in rank order."""
    context = multiprocessing.get_context("spawn")
    outs = [tmp_path / f"rank{r}.json" for r in range(world)]
    procs = [context.Process(target=rank_main, args=(r, str(tmp_path / "init"), str(outs[r])))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout)
            assert p.exitcode == 0, f"rank process exited with {p.exitcode} (or hung)"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return [json.loads(out.read_text()) for out in outs]
