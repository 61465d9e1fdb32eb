"""A one-shot all-reduce for small tensors between the GPUs of one TP worker (NVLink / P2P).

Why: a decode step of a TP model all-reduces two small activations per layer ([batch, hidden]:
8 KiB at batch 1 for an 8B model). NCCL's latency for such sizes is tens of microseconds, enough
to make a TP=2 batch-1 step of an 8B model as slow as TP=1 though each GPU reads half the
weights; this kernel's latency is a few microseconds (bench/RESULTS.md, tp_decode).

How: every rank owns, in its own GPU memory, a data buffer [2 parities, world, SLOT elements]
and a flag array [world, MAX_PROGRAMS] int32, and maps every other rank's through CUDA IPC. A
call runs one Triton kernel on each rank; its program p, for elements [p * BLOCK, +BLOCK):

    1. epoch = this program's call counter + 1 (kept in device memory: graph replays advance it)
    2. store its slice of x into data[parity][rank] of EVERY rank (remote stores over NVLink)
    3. CTA barrier, then flags[rank][p] = epoch on every rank (release, system scope)
    4. wait until flags[src][p] >= epoch on its own GPU for every src (acquire, system scope)
    5. sum data[parity][src] over src in rank order (fp32), the same order on every rank, so
       every rank gets bit-identical results, as NCCL's all-reduce guarantees; write x in place

Invariants: every rank makes the same calls in the same order with the same sizes (a TP
model's collectives are), so program p's epochs agree across ranks. Data of call e lives in
parity e % 2: a rank can only be one call ahead of another (step 4), so a peer writing call
e + 1 never overwrites what a slower rank still reads of call e. All programs of a launch are
resident at once (at most MAX_PROGRAMS small programs), so the spin of step 4 cannot starve a
program its peer waits for.

Used for tensors of at most MAX_BYTES on CUDA; anything else goes to torch.distributed.
KernelOptions.one_shot_all_reduce (TANDEM_ONE_SHOT_ALL_REDUCE=0) turns it off; it is also off
unless every pair of the group's
GPUs has peer access (decided on all ranks together).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from torch.distributed import ProcessGroup

from tandem.common.logging import get_logger

logger = get_logger(__name__)
MAX_BYTES = 512 * 1024  # larger all-reduces are bandwidth-bound: NCCL's ring does them well
BLOCK = 1024  # elements per program
MAX_WORLD = 8


@triton.jit
def _one_shot_all_reduce_kernel(x_ptr, n, data_ptrs, flag_ptrs, counters_ptr, rank,
                                WORLD: tl.constexpr, SLOT: tl.constexpr,
                                MAX_PROGRAMS: tl.constexpr, BLOCK: tl.constexpr):
    p = tl.program_id(0)
    offs = p * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    epoch = tl.load(counters_ptr + p) + 1
    half = (epoch % 2) * WORLD * SLOT
    x = tl.load(x_ptr + offs, mask=mask)
    for dst in tl.static_range(WORLD):
        data = tl.load(data_ptrs + dst).to(tl.pointer_type(x_ptr.dtype.element_ty))
        tl.store(data + half + rank * SLOT + offs, x, mask=mask)
    tl.debug_barrier()  # every thread's stores happen before the flag's release
    for dst in tl.static_range(WORLD):
        flags = tl.load(flag_ptrs + dst).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(flags + rank * MAX_PROGRAMS + p, epoch, sem="release", scope="sys")
    mine = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
    for src in tl.static_range(WORLD):
        seen = tl.atomic_add(mine + src * MAX_PROGRAMS + p, 0, sem="acquire", scope="sys")
        while seen < epoch:
            seen = tl.atomic_add(mine + src * MAX_PROGRAMS + p, 0, sem="acquire", scope="sys")
    tl.debug_barrier()
    data = tl.load(data_ptrs + rank).to(tl.pointer_type(x_ptr.dtype.element_ty))
    acc = tl.zeros([BLOCK], tl.float32)
    for src in tl.static_range(WORLD):
        acc += tl.load(data + half + src * SLOT + offs, mask=mask,
                       cache_modifier=".cg").to(tl.float32)
    tl.store(x_ptr + offs, acc.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(counters_ptr + p, epoch)


def _share(tensor: torch.Tensor) -> tuple:
    """What another process needs to map `tensor` (its storage's CUDA IPC fields)."""
    return tensor.untyped_storage()._share_cuda_(), tensor.numel()


def _open(shared: tuple, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    fields, numel = shared
    (_, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle,
     event_sync) = fields
    storage = torch.UntypedStorage._new_shared_cuda(
        device.index, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle,
        event_sync)
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, (numel,), (1,))


class OneShotAllReduce:
    """One rank's end; build it on every rank of the group at once (`create`)."""

    def __init__(self, rank: int, world: int, device: torch.device,
                 buffers: list[torch.Tensor], flags: list[torch.Tensor]) -> None:
        self.rank, self.world, self.device = rank, world, device
        self._buffers, self._flags = buffers, flags  # every rank's, mapped (keep alive)
        self._data_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64,
                                       device=device)
        self._flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64,
                                       device=device)
        self._counters = torch.zeros(MAX_BYTES // 2 // BLOCK, dtype=torch.int32, device=device)

    @classmethod
    def create(cls, group: ProcessGroup | None, device: torch.device,
               enabled: bool = True) -> OneShotAllReduce | None:
        """Collective over `group` (the gloo control group): None on every rank when any rank
        cannot use it (no peer access, more than MAX_WORLD ranks, turned off: enabled is
        KernelOptions.one_shot_all_reduce)."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        usable = (enabled and device.type == "cuda" and torch.version.hip is None
                  and 2 <= world <= MAX_WORLD)
        index = device.index if device.index is not None else torch.cuda.current_device()
        device = torch.device("cuda", index)
        votes = [None] * world
        dist.all_gather_object(votes, (usable, index), group=group)
        indices = [i for _, i in votes]
        usable = all(ok for ok, _ in votes) and all(
            i == index or torch.cuda.can_device_access_peer(index, i) for i in indices)
        verdicts = [None] * world
        dist.all_gather_object(verdicts, usable, group=group)
        if not all(verdicts):
            logger.info("one-shot all-reduce off (one_shot_all_reduce off, no peer "
                        "access between the GPUs, or not CUDA); NCCL does every all-reduce")
            return None
        # Bytes: 2 parities x world slots of MAX_BYTES; viewed as the caller's dtype in-kernel.
        buffer = torch.zeros(2 * world * MAX_BYTES // 4, dtype=torch.int32, device=device)
        flags = torch.zeros(world * (MAX_BYTES // 2 // BLOCK), dtype=torch.int32, device=device)
        shared = [None] * world
        dist.all_gather_object(shared, (_share(buffer), _share(flags)), group=group)
        buffers, flag_arrays = [], []
        try:
            for peer, (peer_buffer, peer_flags) in enumerate(shared):
                if peer == rank:
                    buffers.append(buffer)
                    flag_arrays.append(flags)
                else:
                    buffers.append(_open(peer_buffer, device, torch.int32))
                    flag_arrays.append(_open(peer_flags, device, torch.int32))
            mapped = True
        except RuntimeError as exc:  # CUDA refused a handle (e.g. a separate IPC namespace)
            logger.warning("rank %d: mapping the one-shot all-reduce buffers failed: %s",
                           rank, exc)
            mapped = False
        torch.cuda.synchronize(device)
        mapped_everywhere = [None] * world  # also the barrier: every rank's buffers are zeroed
        dist.all_gather_object(mapped_everywhere, mapped, group=group)
        if not all(mapped_everywhere):
            logger.warning("one-shot all-reduce off: a rank could not map its peers' buffers; "
                           "NCCL does every all-reduce")
            return None
        logger.info("one-shot all-reduce over %d GPUs for tensors up to %d KiB", world,
                    MAX_BYTES // 1024)
        return cls(rank, world, device, buffers, flag_arrays)

    def fits(self, x: torch.Tensor) -> bool:
        return (x.device == self.device and x.is_contiguous()
                and x.numel() * x.element_size() <= MAX_BYTES
                and x.dtype in (torch.bfloat16, torch.float16, torch.float32))

    def __call__(self, x: torch.Tensor) -> None:
        """x <- the sum of every rank's x, in place."""
        n = x.numel()
        slot = MAX_BYTES // x.element_size()
        _one_shot_all_reduce_kernel[(triton.cdiv(n, BLOCK),)](
            x, n, self._data_ptrs, self._flag_ptrs, self._counters, self.rank,
            WORLD=self.world, SLOT=slot, MAX_PROGRAMS=MAX_BYTES // 2 // BLOCK, BLOCK=BLOCK,
            num_warps=4)
