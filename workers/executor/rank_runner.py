"""Both sides of a TP worker's step protocol: rank 0 leads, followers replay.

Rank 0 (`LeaderRunner`) wraps its ModelRunner: for each step it prepares the inputs, sends
them to the followers (messages.py), and runs the model like every other rank, so the model's
all-reduces pair up. Followers (`follow_leader`) loop: receive a command, do it, repeat.

Invariant: collectives on a worker's groups are issued in the same order on every rank. On
rank 0 they are issued only by the thread that drives the engine (the engine thread while it
runs; the constructing or stopping thread before and after), never by a gRPC handler. KV
transfers reach the other ranks' shards as KV rank ops inside a STEP (kv/rank_ops.py), which
every rank runs before the step's model inputs, if any: the protocol has no KV commands.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tandem.common.logging import get_logger
from tandem.workers.engine.config import EngineConfig
from tandem.workers.engine.model_runner import ModelRunner
from tandem.workers.engine.scheduler import SchedulerOutput
from tandem.workers.executor.followers import FollowerProcesses
from tandem.workers.executor.step_inputs import (has_model_inputs, pack_inputs,
                                                 unpack_inputs, unpack_kv_ops)
from tandem.workers.kv.block_payload import KVCaches
from tandem.workers.kv.rank_ops import RankKV, decode_ops
from tandem.workers.parallel.control_gathers import all_gather_ints
from tandem.workers.parallel.messages import (MESSAGE_LEN, Command, frame_command,
                                              make_header, split_message)
from tandem.workers.parallel.process_group import (destroy_rank_group, init_rank_group,
                                                   open_leader_store)

logger = get_logger(__name__)
STOP_TIMEOUT_SECONDS = 10.0


class RankGroup:
    """Rank 0's end of a worker's process group: the followers and the control channel."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.tp_size = config.tensor_parallel_size
        self._store = open_leader_store(self.tp_size)  # must outlive the group's rendezvous
        self.followers = FollowerProcesses(config, self._store.port)
        try:
            self.followers.wait_joined(self._store)
            self.control_group = init_rank_group(
                self._store, 0, self.tp_size, device,
                config.kernel_options.one_shot_all_reduce)
        except BaseException:
            self.followers.kill()
            raise
        self._is_stopped = False

    def send(self, header: torch.Tensor, payload: torch.Tensor | None = None) -> None:
        message, rest = frame_command(header, payload)
        dist.broadcast(message, 0, group=self.control_group)
        if rest is not None:
            dist.broadcast(rest, 0, group=self.control_group)

    @contextmanager
    def fatal_on_error(self, what: str) -> Iterator[None]:
        """Around a sequence of collectives: if it raises part-way, the ranks no longer agree
        on what comes next, so the group is ended (followers killed; a watcher sees it)."""
        try:
            yield
        except BaseException:
            logger.exception("%s failed on rank 0; ending the follower ranks", what)
            self.followers.end_after_failure()
            raise

    def smallest_kv_blocks(self, size_own: Callable[[], int], uses_cuda_graphs: bool) -> int:
        """Every rank sizes its own KV cache from its memory (PROFILE_MEMORY; size_own runs
        rank 0's part); the smallest count, which every rank then allocates, is returned."""
        self.send(make_header(Command.PROFILE_MEMORY, int(uses_cuda_graphs)))
        return smallest_kv_blocks(size_own, self.control_group)

    def shutdown(self) -> None:
        """Tell the followers to stop, wait for them, leave the group. Idempotent."""
        if self._is_stopped:
            return
        self._is_stopped = True
        try:
            self.send(make_header(Command.STOP))
        except Exception as exc:  # a follower already died: kill the rest below
            logger.warning("could not send STOP to the followers: %s", exc)
        self.followers.wait_exited(STOP_TIMEOUT_SECONDS)
        destroy_rank_group()


class LeaderRunner:
    """Rank 0's model runner: what the engine calls, with every step mirrored on the followers."""

    def __init__(self, runner: ModelRunner, group: RankGroup) -> None:
        self.runner = runner
        self.group = group
        num_kv_blocks = runner.kv_caches[0][0].shape[0]
        group.send(make_header(Command.KV_BLOCKS, num_kv_blocks))

    @property
    def kv_caches(self) -> KVCaches:
        """Rank 0's shard of the KV cache."""
        return self.runner.kv_caches

    @property
    def tp_size(self) -> int:
        return self.group.tp_size

    @property
    def graphs(self):
        return self.runner.graphs

    def enable_cuda_graphs(self, capture_sizes: list[int], max_model_len: int) -> None:
        """Every rank captures the same decode graphs (rank 0 here, the followers on
        CAPTURE_GRAPHS); each rank's later STEP replays the graph of the same batch size."""
        with self.group.fatal_on_error("CUDA graph capture"):
            self.group.send(make_header(Command.CAPTURE_GRAPHS, max_model_len,
                                        len(capture_sizes)),
                            torch.tensor(capture_sizes, dtype=torch.int64))
            self.runner.enable_cuda_graphs(capture_sizes, max_model_len)

    def release_cuda_graphs(self) -> None:
        """Rank 0's graphs (followers free theirs by exiting)."""
        self.runner.release_cuda_graphs()

    @torch.inference_mode()
    def run(self, batch: SchedulerOutput) -> torch.Tensor:
        inputs = self.runner.prepare_inputs(batch)
        with self.group.fatal_on_error("model step"):
            self.group.send(*pack_inputs(inputs))
            return self.runner.execute(inputs)


def follow_leader(runner: ModelRunner, control_group: ProcessGroup | None,
                  device: torch.device) -> None:
    """A follower's life after loading: replay rank 0's commands until STOP.

    Raises (and the process should exit) when rank 0 goes away mid-collective."""
    rank_kv = RankKV(runner.kv_caches, device, dist.get_rank(), dist.get_world_size())
    while True:
        header, payload = receive_command(control_group)
        command = Command(int(header[0]))
        if command is Command.STOP:
            return  # the rank's connector goes with the process
        if command is Command.STEP:
            kv_ops = unpack_kv_ops(header, payload)
            if kv_ops:  # before the model: a step's loads start as early as they can
                rank_kv.run(decode_ops(kv_ops), control_group)
            if has_model_inputs(header):
                with torch.inference_mode():
                    runner.execute(unpack_inputs(header, payload, device))
        elif command is Command.CAPTURE_GRAPHS:
            runner.enable_cuda_graphs(payload.tolist(), int(header[1]))
        else:
            raise RuntimeError(f"unexpected command {command.name}")


def smallest_kv_blocks(size_own: Callable[[], int], control_group: ProcessGroup | None) -> int:
    """Runs this rank's sizing (every rank at once: a GPU profile's forward all-reduces) and
    returns the smallest count of all ranks. A rank whose cache does not fit reports 0 so the
    others do not wait for it: it raises its own ValueError, the others one naming it."""
    try:
        own, error = size_own(), None
    except ValueError as exc:
        own, error = 0, exc
    counts = all_gather_ints(own, control_group)
    if error is not None:
        raise error
    failed = [rank for rank, count in enumerate(counts) if count < 1]
    if failed:
        raise ValueError(f"the KV cache does not fit on TP rank(s) {failed} (their logs say "
                         "which sizes); raise gpu_memory_utilization or lower max_model_len")
    return min(counts)


def num_kv_blocks_from_leader(control_group: ProcessGroup | None,
                              size_own: Callable[[bool], int]) -> int | None:
    """How many KV blocks rank 0 allocated, after this rank's part of PROFILE_MEMORY when
    rank 0 sends it first (size_own(uses_cuda_graphs): this rank's own count). None: rank 0
    stopped before it finished loading."""
    header, _ = receive_command(control_group)
    command = Command(int(header[0]))
    if command is Command.PROFILE_MEMORY:
        uses_cuda_graphs = bool(header[1])
        smallest_kv_blocks(lambda: size_own(uses_cuda_graphs), control_group)
        header, _ = receive_command(control_group)
        command = Command(int(header[0]))
    if command is Command.STOP:
        return None
    if command is not Command.KV_BLOCKS:
        raise RuntimeError(f"expected KV_BLOCKS first, got {command.name}")
    return int(header[1])


def receive_command(control_group: ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A follower's receipt of one command sent by RankGroup.send: (header, payload)."""
    message = torch.empty(MESSAGE_LEN, dtype=torch.int64)
    dist.broadcast(message, 0, group=control_group)
    header, payload, still_to_come = split_message(message)
    if still_to_come:
        rest = torch.empty(still_to_come, dtype=torch.int64)
        dist.broadcast(rest, 0, group=control_group)
        payload = torch.cat([payload, rest])
    return header, payload
