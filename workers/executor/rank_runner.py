"""Both sides of a TP worker's step protocol: rank 0 leads, followers replay.

Rank 0 (`LeaderRunner`) wraps its ModelRunner: for each step it prepares the inputs, sends
them to the followers (messages.py), and runs the model like every other rank, so the model's
all-reduces pair up. Followers (`follow_leader`) loop: receive a command, do it, repeat.

Invariant: collectives on a worker's groups are issued in the same order on every rank. On
rank 0 they are issued only by the thread that drives the engine (the engine thread while it
runs; the constructing or stopping thread before and after), never by a gRPC handler: the
KV handoff reaches the other ranks' shards through `gather_kv_blocks` / `scatter_kv_blocks`,
which the servicers run as engine commands, cuda-ipc handoffs through `setup_kv_ipc`,
`map_kv_peer`, `post_kv_copy` and `poll_kv_copy` (ipc_ranks.py), and nixl handoffs through the
`*_kv_nixl*` methods (nixl_ranks.py).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tandem.common.kv_exports import (CudaIpcCache, CudaIpcExport, NixlAgentExport,
                                      cuda_ipc_cache_from_bytes, to_bytes)
from tandem.common.kv_layout import KVLayout
from tandem.common.logging import get_logger
from tandem.workers.engine.config import EngineConfig
from tandem.workers.engine.model_runner import ModelRunner
from tandem.workers.engine.scheduler import SchedulerOutput
from tandem.workers.executor.followers import FollowerProcesses
from tandem.workers.parallel.control_gathers import (all_gather_bytes, all_gather_ints,
                                                     failed_ranks)
from tandem.workers.parallel.ipc_ranks import RankIpcPeers, follow_ipc_command
from tandem.workers.parallel.kv_shards import (KVCaches, join_shares, layer_widths,
                                               local_share, share_shape, split_joined,
                                               write_local_share)
from tandem.workers.executor.step_inputs import pack_inputs, unpack_inputs
from tandem.workers.parallel.messages import (MESSAGE_LEN, Command, frame_command,
                                              make_header, pack_bytes, split_message)
from tandem.workers.parallel.nixl_ranks import (RankNixl, follow_nixl_command,
                                                merge_rank_exports)
from tandem.workers.parallel.rank_transfers import TransferOutcome
from tandem.workers.parallel.process_group import (destroy_rank_group, init_rank_group,
                                                   open_leader_store)

logger = get_logger(__name__)
STOP_TIMEOUT_SECONDS = 10.0
IPC_COMMANDS = (Command.IPC_SETUP, Command.IPC_MAP, Command.IPC_POST, Command.IPC_POLL)
NIXL_COMMANDS = (Command.NIXL_SETUP, Command.NIXL_LOAD, Command.NIXL_POST, Command.NIXL_POLL,
                 Command.NIXL_UNLOAD)


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
        self._ipc: RankIpcPeers | None = None
        self._nixl = RankNixl(self.kv_caches, 0)

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

    def gather_kv_blocks(self, block_ids: list[int]) -> KVCaches:
        """Every rank's KV heads of `block_ids`, joined (kv_shards.py); block i of the result
        is block_ids[i]. Engine thread only."""
        with self.group.fatal_on_error("KV gather"):
            self.group.send(make_header(Command.GATHER_KV, len(block_ids)),
                            torch.tensor(block_ids, dtype=torch.int64))
            share = local_share(self.kv_caches, block_ids)
            shares = [torch.empty_like(share) for _ in range(self.tp_size)]
            dist.gather(share, shares, dst=0)
        return join_shares(shares, layer_widths(self.kv_caches))

    def scatter_kv_blocks(self, block_ids: list[int], joined: KVCaches) -> None:
        """Write joined KV (as `gather_kv_blocks` returns it) into `block_ids` on every rank.
        Engine thread only."""
        device = self.kv_caches[0][0].device
        shares = [s.to(device) for s in split_joined(joined, self.tp_size)]
        with self.group.fatal_on_error("KV scatter"):
            self.group.send(make_header(Command.SCATTER_KV, len(block_ids)),
                            torch.tensor(block_ids, dtype=torch.int64))
            mine = torch.empty_like(shares[0])
            dist.scatter(mine, shares, src=0)
        write_local_share(self.kv_caches, block_ids, mine)

    def setup_kv_ipc(self) -> list[CudaIpcCache]:
        """Readies cuda-ipc on every rank (ipc_ranks.py); returns every rank's cache export in
        rank order (CudaIpcExporter's rank_caches). Engine thread only."""
        with self.group.fatal_on_error("cuda-ipc setup"):
            self.group.send(make_header(Command.IPC_SETUP))
            exports = all_gather_bytes(self._ipc_peers().setup(), self.group.control_group)
        return [cuda_ipc_cache_from_bytes(data) for data in exports]

    def map_kv_peer(self, slot: int, export: CudaIpcExport) -> list[int]:
        """Every rank r maps the source's rank r cache under `slot`; returns the ranks where
        CUDA refused (empty: mapped everywhere). Engine thread only."""
        data = to_bytes(export)
        with self.group.fatal_on_error("cuda-ipc map"):
            self.group.send(make_header(Command.IPC_MAP, slot, len(data)), pack_bytes(data))
            return failed_ranks(self._ipc_peers().map(slot, export),
                                self.group.control_group)

    def post_kv_copy(self, transfer: int, slot: int, src_ids: list[int],
                     dst_ids: list[int]) -> TransferOutcome:
        """Every rank queues the copy of its share of src_ids (the source mapped under `slot`)
        into dst_ids as `transfer`; returns the group's outcome so far (poll_kv_copy until it
        is settled). Engine thread only."""
        ids = torch.tensor([*src_ids, *dst_ids], dtype=torch.int64)
        with self.group.fatal_on_error("cuda-ipc copy"):
            self.group.send(make_header(Command.IPC_POST, transfer, slot, len(src_ids)), ids)
            return self._ipc_peers().post(transfer, slot, src_ids, dst_ids,
                                          self.group.control_group)

    def poll_kv_copy(self, transfer: int, finish: bool = False) -> TransferOutcome:
        """Every rank checks (with finish: waits out) its copy of `transfer`; returns the
        group's outcome. Engine thread only."""
        with self.group.fatal_on_error("cuda-ipc poll"):
            self.group.send(make_header(Command.IPC_POLL, transfer, int(finish)))
            return self._ipc_peers().poll(transfer, finish, self.group.control_group)

    def _ipc_peers(self) -> RankIpcPeers:
        if self._ipc is None:
            self._ipc = RankIpcPeers(self.kv_caches, self.kv_caches[0][0].device, 0)
        return self._ipc

    def setup_kv_nixl(self, layout: KVLayout) -> NixlAgentExport:
        """Every rank creates its NIXL agent (nixl_ranks.py); returns the worker's export
        (rank 0's, with every rank's in `ranks`). Engine thread only."""
        data = to_bytes(layout)
        with self.group.fatal_on_error("NIXL setup"):
            self.group.send(make_header(Command.NIXL_SETUP, len(data)), pack_bytes(data))
            exports = all_gather_bytes(self._nixl.setup(layout), self.group.control_group)
        return merge_rank_exports(exports)

    def load_kv_nixl_peer(self, slot: int, export: NixlAgentExport) -> list[int]:
        """Every rank r loads the source's rank r agent under `slot`; returns the ranks that
        could not. Engine thread only."""
        data = to_bytes(export)
        with self.group.fatal_on_error("NIXL load"):
            self.group.send(make_header(Command.NIXL_LOAD, slot, len(data)), pack_bytes(data))
            return failed_ranks(self._nixl.load(slot, export), self.group.control_group)

    def unload_kv_nixl_peer(self, slot: int) -> None:
        with self.group.fatal_on_error("NIXL unload"):
            self.group.send(make_header(Command.NIXL_UNLOAD, slot))
            self._nixl.unload(slot)

    def post_kv_nixl_read(self, transfer: int, slot: int, src_ids: list[int],
                          dst_ids: list[int], timeout: float) -> TransferOutcome:
        """Every rank posts the READ of its heads of src_ids (the source under `slot`) into
        dst_ids as `transfer`, lasting at most `timeout` seconds; returns the group's outcome
        so far (poll_kv_nixl_read until it is settled). Engine thread only."""
        ids = torch.tensor([*src_ids, *dst_ids], dtype=torch.int64)
        timeout_ms = max(1, int(timeout * 1000))
        with self.group.fatal_on_error("NIXL read"):
            self.group.send(make_header(Command.NIXL_POST, transfer, slot, len(src_ids),
                                        timeout_ms), ids)
            return self._nixl.post(transfer, slot, src_ids, dst_ids, timeout_ms / 1000,
                                   self.group.control_group)

    def poll_kv_nixl_read(self, transfer: int, cancel: bool = False) -> TransferOutcome:
        """Every rank checks (or, with cancel, aborts) its READ of `transfer`; returns the
        group's outcome. Engine thread only."""
        with self.group.fatal_on_error("NIXL poll"):
            self.group.send(make_header(Command.NIXL_POLL, transfer, int(cancel)))
            return self._nixl.poll(transfer, cancel, self.group.control_group)

    def close_kv_nixl(self) -> None:
        """Rank 0's agent deregisters its cache (at shutdown, after the engine stopped)."""
        self._nixl.close()


def follow_leader(runner: ModelRunner, control_group: ProcessGroup | None,
                  device: torch.device) -> None:
    """A follower's life after loading: replay rank 0's commands until STOP.

    Raises (and the process should exit) when rank 0 goes away mid-collective."""
    ipc: RankIpcPeers | None = None  # made on the first cuda-ipc command
    nixl: RankNixl | None = None  # made on the first nixl command
    while True:
        header, payload = receive_command(control_group)
        command = Command(int(header[0]))
        if command is Command.STOP:
            return
        if command is Command.STEP:
            with torch.inference_mode():
                runner.execute(unpack_inputs(header, payload, device))
        elif command is Command.GATHER_KV:
            dist.gather(local_share(runner.kv_caches, payload.tolist()), None, dst=0)
        elif command is Command.CAPTURE_GRAPHS:
            runner.enable_cuda_graphs(payload.tolist(), int(header[1]))
        elif command is Command.SCATTER_KV:
            block_ids = payload.tolist()
            like = runner.kv_caches[0][0]
            mine = torch.empty(share_shape(runner.kv_caches, len(block_ids)),
                               dtype=like.dtype, device=like.device)
            dist.scatter(mine, None, src=0)
            write_local_share(runner.kv_caches, block_ids, mine)
        elif command in IPC_COMMANDS:
            ipc = ipc or RankIpcPeers(runner.kv_caches, device, dist.get_rank())
            follow_ipc_command(ipc, command, header, payload, control_group)
        elif command in NIXL_COMMANDS:
            nixl = nixl or RankNixl(runner.kv_caches, dist.get_rank())
            follow_nixl_command(nixl, command, header, payload, control_group)
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
