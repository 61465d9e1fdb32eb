"""Rank 0's follower processes: start them, wait until they reach the rendezvous, stop them.

Each follower is `python -m tandem.workers.executor.follower` with the engine's config as
JSON; it writes to rank 0's stdout/stderr. No follower outlives rank 0:
  * a clean stop sends STOP (see rank_runner.py), then `stop()` waits and kills stragglers;
  * rank 0 exiting without a clean stop kills them from an atexit hook;
  * rank 0 dying (SIGKILL) is noticed by each follower: its parent pid changes, and its next
    collective fails on the closed connection (see follower.py).
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch

from tandem.common.logging import get_logger
from tandem.workers.engine.config import EngineConfig
from tandem.workers.parallel.process_group import RENDEZVOUS_TIMEOUT, joined_key

logger = get_logger(__name__)
POLL_SECONDS = 0.05
WATCH_SECONDS = 0.5


class FollowerProcesses:
    """Ranks 1..world_size-1 of one worker, started by rank 0."""

    def __init__(self, config: EngineConfig, store_port: int) -> None:
        world_size = config.tensor_parallel_size
        config_json = json.dumps(dataclasses.asdict(config))
        self.processes: list[subprocess.Popen] = []
        for rank in range(1, world_size):
            argv = [sys.executable, "-m", "tandem.workers.executor.follower",
                    "--rank", str(rank), "--world-size", str(world_size),
                    "--store-port", str(store_port), "--parent-pid", str(os.getpid()),
                    "--num-threads", str(torch.get_num_threads()),
                    "--engine-config", config_json]
            self.processes.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL))
        logger.info("started %d follower rank(s): pids %s", len(self.processes),
                    ", ".join(str(p.pid) for p in self.processes))
        self._is_stopping = False
        atexit.register(self.kill)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def wait_joined(self, store, timeout: float = RENDEZVOUS_TIMEOUT.total_seconds()) -> None:
        """Block until every follower reached the rendezvous; RuntimeError naming the rank if
        one exits first or the timeout passes (rank 0 would otherwise wait in init)."""
        deadline = time.monotonic() + timeout
        for rank, process in enumerate(self.processes, start=1):
            while not store.check([joined_key(rank)]):
                if process.poll() is not None:
                    raise RuntimeError(f"follower rank {rank} (pid {process.pid}) exited with "
                                       f"code {process.returncode} before joining the group")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"follower rank {rank} did not join within {timeout:g} s")
                time.sleep(POLL_SECONDS)

    def watch(self, on_unexpected_exit: Callable[[], None]) -> None:
        """Call on_unexpected_exit (once, from a watcher thread) if a follower exits before
        rank 0 stops them: the model cannot run without it."""

        def poll() -> None:
            while not self._is_stopping:
                for rank, process in enumerate(self.processes, start=1):
                    if process.poll() is not None and not self._is_stopping:
                        logger.error("follower rank %d (pid %d) exited with code %s; this "
                                     "worker cannot run its model any more", rank, process.pid,
                                     process.returncode)
                        on_unexpected_exit()
                        return
                time.sleep(WATCH_SECONDS)

        threading.Thread(target=poll, name="follower-watch", daemon=True).start()

    def wait_exited(self, timeout: float) -> None:
        """Wait for followers that were told to stop; kill the ones still running after it."""
        self._is_stopping = True
        deadline = time.monotonic() + timeout
        for rank, process in enumerate(self.processes, start=1):
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("follower rank %d (pid %d) did not stop; killing it", rank,
                               process.pid)
        self.kill()

    def end_after_failure(self) -> None:
        """Kill the followers because rank 0 failed mid-collective; unlike `kill`, a `watch`er
        reports it (the worker must stop)."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()

    def kill(self) -> None:
        self._is_stopping = True
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        atexit.unregister(self.kill)
