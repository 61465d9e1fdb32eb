"""torch.distributed setup shared by rank 0 and its followers.

One worker = one process group of tensor_parallel_size processes on this host, rendezvousing
through a TCPStore that rank 0 opens on 127.0.0.1 (an OS-chosen port, so no port race).
Two groups of collectives:

  * the default group (nccl on GPUs, gloo on CPU): the model's all-reduces and the KV shards
    (on GPUs, small all-reduces go through the one-shot kernel set up here instead:
    all_reduce.py);
  * the control group (gloo): command headers and step inputs from rank 0. It is the default
    group on CPU and a separate gloo group on GPUs, so control messages never wait on the
    device. Followers idle in a control broadcast for as long as the worker is idle, so its
    timeout is practically unbounded; a dead peer is noticed by its closed connection instead.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tandem.workers.parallel.all_reduce import use_one_shot

STORE_HOST = "127.0.0.1"
RENDEZVOUS_TIMEOUT = timedelta(seconds=300)
DEVICE_GROUP_TIMEOUT = timedelta(minutes=10)
CONTROL_GROUP_TIMEOUT = timedelta(days=365)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r of a worker on cuda:i uses cuda:(i + r); CPU ranks share the CPU."""
    if device.type == "cpu":
        return device
    return torch.device(device.type, (device.index or 0) + rank)


def joined_key(rank: int) -> str:
    return f"tandem/joined/{rank}"


def open_leader_store(world_size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store; followers connect to its `.port`."""
    return dist.TCPStore(STORE_HOST, 0, world_size, is_master=True,
                         timeout=RENDEZVOUS_TIMEOUT, wait_for_workers=False)


def connect_follower_store(port: int, world_size: int) -> dist.TCPStore:
    return dist.TCPStore(STORE_HOST, port, world_size, is_master=False,
                         timeout=RENDEZVOUS_TIMEOUT)


def init_rank_group(store: dist.TCPStore, rank: int, world_size: int,
                    device: torch.device, one_shot_all_reduce: bool = True
                    ) -> ProcessGroup | None:
    """Join the worker's process group; returns the control group (None: the default group).

    Every rank must call this with the same world_size, device type and one_shot_all_reduce
    (False: NCCL does every all-reduce). Raises RuntimeError when this process already
    belongs to a process group (one TP engine per process).
    """
    if dist.is_initialized():
        raise RuntimeError("this process already runs a tensor-parallel engine (a "
                           "torch.distributed process group exists); shut it down first")
    is_gpu = device.type != "cpu"
    if is_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if is_gpu else "gloo", store=store, rank=rank,
                            world_size=world_size,
                            timeout=DEVICE_GROUP_TIMEOUT if is_gpu else CONTROL_GROUP_TIMEOUT)
    if not is_gpu:
        return None
    control_group = dist.new_group(backend="gloo", timeout=CONTROL_GROUP_TIMEOUT)
    from tandem.workers.parallel.one_shot_all_reduce import OneShotAllReduce  # Triton: GPU only

    use_one_shot(OneShotAllReduce.create(control_group, device, one_shot_all_reduce))
    return control_group


def destroy_rank_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
