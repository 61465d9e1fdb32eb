"""A follower rank of a tensor-parallel worker (started by rank 0, never by hand):

    python -m tandem.workers.executor.follower --rank R --world-size N --store-port P
        --parent-pid PID --num-threads T --engine-config JSON

It joins rank 0's process group, loads its shards of the same model, on GPUs sizes its own KV
cache with the other ranks (the smallest count wins), allocates that many blocks, then replays
rank 0's commands until STOP (rank_runner.py). It never outlives rank 0: a watchdog thread
exits when its parent pid changes (rank 0 died), and a collective with a dead rank 0 fails at
once on the closed connection. SIGINT and SIGTERM are
ignored: a Ctrl-C reaches the whole process group, and so does a SIGTERM from systemd (its
default KillMode) or an init that signals the group; rank 0 decides when followers stop, after
draining its in-flight requests, which need every rank to run. SIGUSR1 prints every thread's
Python stack to stderr (for a rank that seems stuck), and the rank goes on.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import threading
import time

PARENT_POLL_SECONDS = 0.5


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem.workers.executor.follower")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--num-threads", type=int, required=True, help="torch threads (rank 0's)")
    p.add_argument("--engine-config", required=True, help="EngineConfig fields as JSON")
    return p


def exit_when_orphaned(parent_pid: int) -> None:
    """Exit this process as soon as `parent_pid` is no longer its parent."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_SECONDS)
        print(f"follower {os.getpid()}: rank 0 (pid {parent_pid}) is gone; exiting",
              file=sys.stderr, flush=True)
        os._exit(3)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def run(args: argparse.Namespace) -> None:
    import torch

    from tandem.workers.engine.config import EngineConfig
    from tandem.workers.engine.cuda_graphs import default_capture_sizes
    from tandem.workers.engine.memory_profile import memory_at_start, size_rank_kv_cache
    from tandem.workers.engine.model_runner import ModelRunner
    from tandem.workers.engine.model_setup import load_model
    from tandem.workers.parallel.context import ParallelContext
    from tandem.workers.parallel.process_group import (connect_follower_store,
                                                       destroy_rank_group, init_rank_group,
                                                       joined_key, rank_device)
    from tandem.workers.executor.rank_runner import follow_leader, num_kv_blocks_from_leader
    from tandem.workers.ops import kernel_options

    torch.set_num_threads(args.num_threads)
    config = EngineConfig(**json.loads(args.engine_config))
    parallel = ParallelContext(args.rank, args.world_size, config.enable_expert_parallel)
    device = rank_device(config.torch_device(), args.rank)
    store = connect_follower_store(args.store_port, args.world_size)
    store.set(joined_key(args.rank), "1")
    kernel_options.install(config.kernel_options)
    control_group = init_rank_group(store, args.rank, args.world_size, device,
                                    config.kernel_options.one_shot_all_reduce)
    try:
        start = memory_at_start(device)
        loaded = load_model(config, parallel)

        def size_own(uses_cuda_graphs: bool) -> int:
            capture_sizes = default_capture_sizes(config.max_num_seqs) if uses_cuda_graphs \
                else []
            return size_rank_kv_cache(config, loaded, start, capture_sizes).num_blocks

        num_kv_blocks = num_kv_blocks_from_leader(control_group, size_own)
        if num_kv_blocks is not None:  # None: rank 0 stopped before it finished loading
            runner = ModelRunner(loaded.model, num_kv_blocks, config.block_size, loaded.dtype,
                                 loaded.device)
            follow_leader(runner, control_group, loaded.device)
    except BaseException:
        destroy_rank_group()
        raise
    # Told to stop: exit without tearing the process group down. NCCL's teardown waits for
    # every rank's, and rank 0 tears down only once its followers have exited, so a teardown
    # here blocked until rank 0's stop timeout killed us (seen on 2 H200s); the OS releases
    # the communicators at exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    exit_when_orphaned(args.parent_pid)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
