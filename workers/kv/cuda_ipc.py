"""The `cuda-ipc` KV transfer backend's GPU side: share a KV cache through CUDA IPC, map a
peer's cache, and copy blocks GPU to GPU (never through host memory).

    exporter = CudaIpcExporter(kv_caches, layout)   # prefill worker, once (TP: rank 0, with
                                                     # every rank's export_rank_cache)
    exporter.export()                                # -> kv_exports.CudaIpcExport
    peer = open_peer(export, local_device, rank)     # decode worker (every TP rank), once
                                                     # per peer export_id
    copier = BlockCopier(peer.caches, local_caches)  # once per mapping
    copier.launch(src_ids, dst_ids, stream)          # per handle: a CUDA event to wait on

Invariants (the lease/pin rules of kv_transfer_service.py apply unchanged):

* The prefill worker's engine writes a block only while that block is allocated to a request it
  is computing. Blocks of a pinned handle are complete (the prefill step that pinned them read
  its sampled token back to the host, which waited for every kernel before it) and nobody
  writes them until ReleaseKV or the lease ends. So the decode worker reads only blocks that
  the handle names (CudaIpcEndpoint.block_ids, pinned until lease_deadline_monotonic on this
  host's monotonic clock) or LeaseKV returned, only while that lease lasts, and releases after
  its copy has completed (its event synchronized).
* The decode worker writes only blocks it reserved and has not yet activated: the engine does
  not touch them until activate_prefilled, which runs after the copy's event completed.
* Nobody writes a peer's mapped cache: the decode side only reads it.
* A mapping lives as long as the peer's cache: the exporter's caches are allocated once per
  process; a restarted peer has a new export_id, and a mapping whose export_id differs from the
  handle's is reopened, never used.

The peer's memory is opened on the decode worker's own device (CUDA maps it through peer
access, NVLink on one host), so the gather kernel runs on the decode GPU and reads the peer's
HBM directly; the decode process creates no context on the prefill GPU.
"""
from __future__ import annotations

import math
import socket
import uuid
from dataclasses import dataclass

import torch

from tandem.common.kv_exports import CudaIpcCache, CudaIpcEndpoint, CudaIpcExport, CudaIpcTensor
from tandem.common.kv_layout import KVLayout
from tandem.workers.kv.block_payload import KVCaches


class CudaIpcUnavailable(RuntimeError):
    """cuda-ipc cannot be used with this peer (different host, no peer access, IPC refused)."""


def host_id() -> str:
    """Same string in every process of one host (and one boot); different across hosts."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def flat_caches(kv_caches: KVCaches) -> list[torch.Tensor]:
    """Layer-major list of cache tensors: K0, V0, K1, V1, ... (MHA), L0, L1, ... (MLA) or
    L0, I0, L1, I1, ... (sparse MLA: latent and indexer keys, which stacked_view cannot join:
    BlockCopier then copies tensor by tensor)."""
    return [cache for caches in kv_caches for cache in caches]


def stacked_view(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One [len(tensors), *shape] view of tensors that are equally spaced, non-overlapping
    views of one storage with contiguous blocks (as ModelRunner allocates them: block-major,
    tensor t's block b at b * stride(0) + t * spacing; or layer-major, one tensor after the
    other), else None. Lets one gather kernel serve every layer."""
    first = tensors[0]
    if len(tensors) == 1:
        return first.unsqueeze(0)
    spacing = tensors[1].storage_offset() - first.storage_offset()
    block = first[0].numel()
    extent = (first.shape[0] - 1) * first.stride(0) + block  # elements one tensor spans
    layer_major = spacing >= extent
    block_major = block <= spacing and len(tensors) * spacing <= first.stride(0)
    if not first[0].is_contiguous() or not (layer_major or block_major):
        return None
    base = first.untyped_storage().data_ptr()
    for i, t in enumerate(tensors):
        if (t.untyped_storage().data_ptr() != base or t.shape != first.shape
                or t.stride() != first.stride() or t.dtype != first.dtype
                or t.storage_offset() != first.storage_offset() + i * spacing):
            return None
    return first.as_strided((len(tensors), *first.shape), (spacing, *first.stride()),
                            first.storage_offset())


def export_rank_cache(kv_caches: KVCaches) -> CudaIpcCache:
    """This process's cache tensors as CUDA IPC handles (one TP rank's share of an export).
    Call once per process: sharing a storage again would wrap its data pointer again."""
    tensors = flat_caches(kv_caches)
    if tensors[0].device.type != "cuda":
        raise ValueError("cuda-ipc needs the KV cache on a CUDA device")
    shared: dict[int, tuple] = {}  # storage data_ptr -> its _share_cuda_() fields
    messages = []
    for t in tensors:
        storage = t.untyped_storage()
        fields = shared.get(storage.data_ptr())
        if fields is None:
            fields = shared[storage.data_ptr()] = storage._share_cuda_()
        (_, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle,
         event_sync) = fields
        messages.append(CudaIpcTensor(
            storage_handle=handle, storage_size_bytes=size_bytes,
            storage_offset_bytes=offset_bytes, ref_counter_handle=ref_handle,
            ref_counter_offset=ref_offset, event_handle=event_handle or b"",
            event_sync_required=bool(event_sync), shape=tuple(t.shape),
            stride=tuple(t.stride()), storage_offset=t.storage_offset()))
    return CudaIpcCache(device_uuid=device_uuid(tensors[0].device), tensors=tuple(messages))


class CudaIpcExporter:
    """Prefill side: the IPC handles of the whole cache, made once and served to every peer.
    rank_caches: every TP rank's export_rank_cache in rank order (kv/startup.py gathers them
    from every rank's cuda-ipc connector), so ranks[r] is rank r's share; None: this
    process's cache is the one rank."""

    def __init__(self, kv_caches: KVCaches, layout: KVLayout,
                 rank_caches: list[CudaIpcCache] | None = None) -> None:
        if rank_caches is None:
            rank_caches = [export_rank_cache(kv_caches)]
        if len(rank_caches) != layout.tp_size:
            raise ValueError(f"cuda-ipc export: {len(rank_caches)} rank caches for a layout of "
                             f"TP size {layout.tp_size}")
        self.layout = layout
        self.endpoint = CudaIpcEndpoint(host_id=host_id(),
                                        device_uuid=rank_caches[0].device_uuid,
                                        export_id=uuid.uuid4().hex)
        self._export = CudaIpcExport(self.endpoint, layout, tuple(rank_caches))

    def export(self) -> CudaIpcExport:
        return self._export


@dataclass
class MappedPeer:
    """Decode side: a peer's cache tensors mapped into this process, on this device."""

    export_id: str
    caches: list[torch.Tensor]  # layer-major, as flat_caches


def open_peer(export: CudaIpcExport, device: torch.device, rank: int = 0) -> MappedPeer:
    """Maps every tensor of the source's rank `rank` on `device` (the receiver's rank of the
    same number: TP sizes match, the layout check saw to it). Raises CudaIpcUnavailable when
    CUDA refuses (another host's handle, no peer access between the GPUs, a separate IPC
    namespace) or the export holds no such rank."""
    if rank >= len(export.ranks):
        raise CudaIpcUnavailable(f"the source exported {len(export.ranks)} rank caches; "
                                 f"this is rank {rank}")
    dtype = getattr(torch, export.layout.dtype)
    index = device.index if device.index is not None else torch.cuda.current_device()
    storages: dict[tuple[bytes, int], torch.UntypedStorage] = {}
    caches = []
    try:
        for m in export.ranks[rank].tensors:
            key = (m.storage_handle, m.storage_offset_bytes)
            storage = storages.get(key)
            if storage is None:
                storage = storages[key] = torch.UntypedStorage._new_shared_cuda(
                    index, m.storage_handle, m.storage_size_bytes, m.storage_offset_bytes,
                    m.ref_counter_handle, m.ref_counter_offset, m.event_handle or None,
                    m.event_sync_required)
            tensor = torch.empty(0, dtype=dtype, device=torch.device("cuda", index))
            tensor.set_(storage, m.storage_offset, tuple(m.shape), tuple(m.stride))
            caches.append(tensor)
    except RuntimeError as exc:
        raise CudaIpcUnavailable(f"CUDA IPC open failed on cuda:{index}: {exc}") from exc
    return MappedPeer(export.endpoint.export_id, caches)


def check_block_pairs(src_ids: list[int], dst_ids: list[int]) -> None:
    """A copy pairs every source block with one destination block (ValueError otherwise)."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"block copy: {len(src_ids)} source blocks for {len(dst_ids)} "
                         f"destination blocks")


class BlockCopier:
    """Copies blocks from one paged cache into another GPU to GPU, built once per cache pair
    (a peer's mapping and the local cache):

        copier = BlockCopier(peer.caches, local_caches)
        done = copier.launch(src_ids, dst_ids, stream)   # queued; done: a CUDA event
        num_bytes = copier.copy(src_ids, dst_ids)         # launch and wait

    src and dst are layer-major lists (flat_caches) on one device; src may be a peer's mapping.
    With Triton, one gather kernel per stacked cache (else one per tensor) reads each source
    block once and writes its destination block directly, its block ids read from a reused
    pinned buffer (pinned_ids.py); without it, index_select + index_copy_ (two passes)."""

    def __init__(self, src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
        if len(src) != len(dst):
            raise ValueError(f"BlockCopier: {len(src)} source tensors, {len(dst)} destination")
        self.src, self.dst = src, dst
        self.device = dst[0].device
        self.block_bytes = sum(math.prod(t.shape[1:]) * t.element_size() for t in dst)
        src_stacked, dst_stacked = stacked_view(src), stacked_view(dst)
        self.pairs = ([(src_stacked, dst_stacked)]
                      if src_stacked is not None and dst_stacked is not None
                      else [(s.unsqueeze(0), d.unsqueeze(0)) for s, d in zip(src, dst)])
        self.gathers = None
        from tandem.workers.ops.backend import triton_available

        if triton_available():
            from tandem.workers.kv.pinned_ids import PinnedBlockIds
            from tandem.workers.ops.gpu.block_copy import BlockGather

            self.gathers = [BlockGather(s, d) for s, d in self.pairs]
            self.ids = PinnedBlockIds()  # the gathers' block ids, reused once read

    def precompile(self) -> None:
        """Compiles the gathers' kernel variants without copying anything (no-op without
        Triton). A copier between the local cache and itself compiles what a peer's will
        launch: Triton's variant key depends on dtype, alignment and divisibility, which
        both sides share."""
        for gather in self.gathers or ():
            gather.precompile()

    @property
    def one_launch(self) -> bool:
        return len(self.pairs) == 1

    def launch(self, src_ids: list[int], dst_ids: list[int],
               stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
        """Queues dst[i][dst_ids] = src[i][src_ids] for every tensor on `stream` (default: the
        current one) after the work already queued on the current stream (the reserved
        blocks' last writers); returns an event that completes with the copy. If it raises,
        nothing it queued is still running."""
        check_block_pairs(src_ids, dst_ids)
        current = torch.cuda.current_stream(self.device)
        stream = stream or current
        if stream != current:
            stream.wait_stream(current)
        done = torch.cuda.Event()
        if not src_ids:
            done.record(stream)
            return done
        # The kernels read the ids from pinned host memory in place (a few KiB over PCIe: no
        # upload to queue) until `done` completes: the buffer goes back to the pool only with
        # `done` (pinned_ids.py), and `done.inputs` keeps it alive even if this copier dies.
        lent = None
        try:
            if self.gathers is None:
                with torch.cuda.stream(stream):
                    done.inputs = self._index_copy(src_ids, dst_ids)  # alive until `done`
            else:
                done.inputs = lent = self.ids.fill(src_ids, dst_ids)
                for gather in self.gathers:
                    gather(lent, stream)
        except BaseException:
            # Work queued before the failure still reads the ids and writes dst blocks: wait it
            # out, so a failed launch leaves nothing running (callers rely on it).
            self._record(done, stream, lent)
            done.synchronize()
            raise
        self._record(done, stream, lent)
        return done

    def _record(self, done: torch.cuda.Event, stream: torch.cuda.Stream,
                lent: torch.Tensor | None) -> None:
        """Records `done` after the copy's work; a lent id buffer comes back with it."""
        done.record(stream)
        if lent is not None:
            self.ids.retire(lent, done)

    def copy(self, src_ids: list[int], dst_ids: list[int],
             stream: torch.cuda.Stream | None = None) -> int:
        """launch, then wait for the copy; returns the bytes copied."""
        self.launch(src_ids, dst_ids, stream).synchronize()
        return len(src_ids) * self.block_bytes

    def _index_copy(self, src_ids: list[int], dst_ids: list[int]) -> torch.Tensor:
        """Without Triton: index_select + index_copy_ on the current stream; returns the
        device tensor of block ids they read."""
        ids = torch.tensor([src_ids, dst_ids], dtype=torch.long).to(self.device,
                                                                     non_blocking=True)
        for s, d in self.pairs:
            d.index_copy_(1, ids[1], s.index_select(1, ids[0]))
        return ids
