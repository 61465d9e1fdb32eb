"""The Worker gRPC service: converts between protobuf and engine types, nothing more.

Every request runs as one handler task; aborting a request cancels that task first, so no
coroutine writes into KV blocks after the engine has freed them. A handler's clean-up queues
the engine-side abort without awaiting it (`_abort_soon`): a handler can be cancelled several
times (its deadline, the client going away, an Abort RPC), and a cancelled await would drop
the abort and leave the request generating to max_tokens.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable

import grpc

from tandem.common.convert import (connector_endpoint_to_proto, cuda_ipc_endpoint_to_proto,
                                   engine_params_from_proto,
                                   finish_reason_to_proto, kv_handle_from_proto,
                                   layout_from_proto, layout_to_proto, logprob_to_proto,
                                   nixl_endpoint_to_proto)
from tandem.common.errors import AlreadyExistsError, OutOfRangeError
from tandem.common.kv_exports import ConnectorEndpoint, CudaIpcEndpoint, NixlEndpoint
from tandem.common.kv_layout import KVLayout, KVLayoutMismatch
from tandem.common.logging import get_logger
from tandem.common.metrics import WorkerMetrics
from tandem.common.security import TLSFiles, open_channel
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem.workers.async_engine import AsyncEngine, BlocksReserved, EngineFailure, TokenEvent
from tandem.workers.decode_stream import DecodeStreamSession
from tandem.workers.engine.sequence import Sequence
from tandem.workers.kv.block_access import KVBlockAccess
from tandem.workers.kv.transport import KVTransferFailed, KVTransportUnavailable
from tandem.workers.kv_transfer_service import KVPeerClient, pull_kv, release_kv
from tandem.workers.kv_events import KVEventPublisher

logger = get_logger(__name__)
ROLES = ("prefill", "decode", "both")
# What a decode worker does when it cannot pull a prompt's KV: compute it locally and go on,
# or fail the call UNAVAILABLE.
KV_PULL_FAILURE_POLICIES = ("recompute", "fail")
# How long a decode request waits for free KV blocks before RESOURCE_EXHAUSTED (default).
MAX_BLOCK_WAIT_SECONDS = 30.0
# While it waits, the source's lease on the prompt's KV is renewed each time half of it passed,
# but not more often than this.
MIN_LEASE_RENEWAL_SECONDS = 0.5
LEASE_RENEWAL_TIMEOUT_SECONDS = 5.0


class PeerChannels:
    """One shared channel per peer worker address (mutual TLS and the internal token when
    configured)."""

    def __init__(self, tls: TLSFiles | None = None, token: str | None = None) -> None:
        self._tls, self._token = tls, token
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = open_channel(address, self._tls,
                                                                  self._token)
        return channel

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, engine: AsyncEngine, role: str, model_name: str, address: str,
                 layout: KVLayout, peers: PeerChannels, blocks: KVBlockAccess,
                 metrics: WorkerMetrics | None = None, kv_receiver=None,
                 kv_transports: list[str] | None = None,
                 cuda_ipc_endpoint: CudaIpcEndpoint | None = None,
                 nixl_endpoint: NixlEndpoint | None = None,
                 connector_endpoints: dict[str, ConnectorEndpoint] | None = None,
                 kv_pull_failure: str = "recompute",
                 max_block_wait_seconds: float = MAX_BLOCK_WAIT_SECONDS) -> None:
        if role not in ROLES:
            raise ValueError(f"role={role!r} is not one of {', '.join(ROLES)}")
        if kv_pull_failure not in KV_PULL_FAILURE_POLICIES:
            raise ValueError(f"kv_pull_failure={kv_pull_failure!r} is not one of "
                             f"{', '.join(KV_PULL_FAILURE_POLICIES)}")
        self.engine = engine
        self.role = role
        self.model_name = model_name
        self.address = address
        self.layout = layout
        self.peers = peers
        self.blocks = blocks  # where pulled KV is written (every TP rank's share)
        self.metrics = metrics
        self.kv_receiver = kv_receiver  # a kv.receiver.KVReceiver; None: grpc only
        self.kv_transports = kv_transports or ["grpc"]  # offered in this worker's handles
        self.cuda_ipc_endpoint = cuda_ipc_endpoint
        self.nixl_endpoint = nixl_endpoint  # set when kv_transports include "nixl"
        self.connector_endpoints = connector_endpoints or {}  # connector backends offered
        self.kv_pull_failure = kv_pull_failure
        if not max_block_wait_seconds > 0:
            raise ValueError(f"max_block_wait_seconds={max_block_wait_seconds} must be > 0")
        self.max_block_wait_seconds = max_block_wait_seconds
        self.instance_id = uuid.uuid4().hex  # new for every process: a restart is told apart
        self._tasks: dict[str, asyncio.Task] = {}
        self._releases: set[asyncio.Task] = set()  # ReleaseKV calls in flight
        self.kv_events = KVEventPublisher(engine)
        self._decode_streams: set[DecodeStreamSession] = set()
        self._is_closing_decode_streams = False

    # -- RPCs ------------------------------------------------------------------------------

    async def Prefill(self, request, context):
        await self._require_role(context, "prefill")
        params = await self._params(request.params, context)
        request_id = request.request_id
        stream = await self._begin(request_id, context)
        try:
            await self._add(context, list(request.prompt_token_ids), params, request_id,
                            pin_after_prefill=request.keep_kv, deadline=_deadline(context))
            event = await self._next_event(stream, context)
            response = worker_pb2.PrefillResponse(
                token_id=event.token_id, finish_reason=finish_reason_to_proto(
                    event.finish_reason.value if event.finish_reason else None),
                num_cached_tokens=event.num_cached_tokens, queue_seconds=event.queue_seconds,
                compute_seconds=event.compute_seconds)
            if event.logprob is not None:
                response.logprob.CopyFrom(logprob_to_proto(event.logprob))
            if event.is_pinned:
                response.kv_handle.CopyFrom(self._handle(request_id,
                                                         len(request.prompt_token_ids), event))
            return response
        except asyncio.CancelledError:
            self._abort_soon(request_id)
            raise
        finally:
            self._end(request_id)

    async def Decode(self, request, context):
        async for response in self._decode(request, context):
            yield response

    async def DecodeStream(self, request_iterator, context):
        session = DecodeStreamSession(self._decode, lambda: self._is_closing_decode_streams)
        self._decode_streams.add(session)
        try:
            async for message in session.responses(request_iterator):
                yield message
        finally:
            self._decode_streams.discard(session)

    def close_decode_streams(self) -> None:
        """Shutting down: DecodeStreams take no new request and end once theirs finish."""
        self._is_closing_decode_streams = True
        for session in self._decode_streams:
            session.wake()

    async def _decode(self, request, context):
        """One request's decode stream; `context` is its call's, or its DecodeStream
        RequestScope."""
        await self._require_role(context, "decode")
        params = await self._params(request.params, context)
        request_id = request.request_id
        prompt = list(request.prompt_token_ids)
        generated = list(request.generated_token_ids)
        stream = await self._begin(request_id, context)
        finished = False
        try:
            pull_seconds = 0.0
            if request.HasField("kv_handle"):
                pull_seconds = await self._receive_kv(request, params, prompt, generated,
                                                      context, stream)
            elif generated:  # migrated: compute the prompt and the tokens made elsewhere
                await self._resume(context, prompt, generated, params, request_id)
            else:
                await self._add(context, prompt, params, request_id,
                                deadline=_deadline(context))
            is_first = True
            while not finished:
                events = await self._next_events(stream, context)
                finished = events[-1].finish_reason is not None
                response = worker_pb2.DecodeResponse(
                    token_ids=[e.token_id for e in events],
                    logprobs=[logprob_to_proto(e.logprob) for e in events if e.logprob],
                    finish_reason=finish_reason_to_proto(
                        events[-1].finish_reason.value if finished else None))
                if is_first:
                    response.num_cached_tokens = events[0].num_cached_tokens
                    response.kv_pull_seconds = pull_seconds
                    is_first = False
                yield response
        finally:
            if not finished:  # cancelled, failed, or the client went away
                self._abort_soon(request_id)
            self._end(request_id)

    async def Abort(self, request, context):
        task = self._tasks.get(request.request_id)
        if task is not None:
            task.cancel()  # its handler aborts the request once it stops touching KV
            return worker_pb2.AbortResponse(found=True)
        found = await self.engine.abort(request.request_id)
        return worker_pb2.AbortResponse(found=found)

    async def GetLoad(self, request, context):
        load = self.engine.load  # published by the engine thread; no need to wait for a step
        return worker_pb2.GetLoadResponse(
            role=self.role, num_running=load.num_running, num_waiting=load.num_waiting,
            kv_usage=load.kv_usage, num_free_blocks=load.num_free_blocks,
            num_pinned=load.num_pinned, model=self.model_name, instance_id=self.instance_id,
            held_request_ids=[request_id for request_id in request.request_ids
                              if request_id in self._tasks
                              or self.engine.holds_request(request_id)])

    async def SubscribeKVEvents(self, request, context):
        async for message in self.kv_events.subscribe(context):
            yield message

    async def ResetPrefixCache(self, request, context):
        num_forgotten = await self.engine.reset_prefix_cache()
        return worker_pb2.ResetPrefixCacheResponse(num_forgotten_blocks=num_forgotten)

    # -- helpers ---------------------------------------------------------------------------

    def _background(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._releases.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._releases.discard)

    async def _begin(self, request_id: str, context) -> asyncio.Queue:
        """Register this handler as the request's; ALREADY_EXISTS (touching nothing) when
        another live handler owns the id, whose stream and clean-up must stay its own."""
        if request_id in self._tasks:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request_id {request_id!r} is already in use")
        self._tasks[request_id] = asyncio.current_task()
        return self.engine.open_stream(request_id)

    def _abort_soon(self, request_id: str) -> None:
        """Queue the request's abort for the engine thread (after every command queued before
        it, such as its add). Not awaited, so no cancellation can drop it."""
        self.engine.abort_soon(request_id)

    def _end(self, request_id: str) -> None:
        self._tasks.pop(request_id, None)
        self.engine.close_stream(request_id)

    async def _require_role(self, context, needed: str) -> None:
        if self.role not in (needed, "both"):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this worker's role is {self.role}; it does not {needed}")

    @staticmethod
    async def _params(message, context):
        try:
            return engine_params_from_proto(message)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _add(self, context, token_ids, params, request_id, **kwargs) -> None:
        await self._queue_request(context, self.engine.add_request(token_ids, params,
                                                                   request_id, **kwargs))

    async def _resume(self, context, prompt, generated, params, request_id) -> None:
        await self._queue_request(context, self.engine.resume_request(
            prompt, generated, params, request_id, deadline=_deadline(context)))

    async def _queue_request(self, context, command: Awaitable[Sequence]) -> None:
        """Awaits an engine command that queues a request; its refusal becomes the status
        that names it."""
        try:
            seq = await command
        except OutOfRangeError as exc:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(exc))
        except AlreadyExistsError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        await self._await_grammar(context, seq)

    async def _await_grammar(self, context, seq) -> None:
        """Waits (on the event loop, holding nothing in the engine) until a constrained
        request's grammar has compiled; INVALID_ARGUMENT naming the problem when it cannot."""
        if seq.grammar is None:
            return
        try:
            # shield: a cancelled call must not cancel a compile that other requests share
            await asyncio.shield(asyncio.wrap_future(seq.grammar.compiled))
        except ValueError as exc:
            self._abort_soon(seq.request_id)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _next_event(self, stream: asyncio.Queue, context) -> TokenEvent:
        event = await stream.get()
        if isinstance(event, EngineFailure):
            await context.abort(grpc.StatusCode.INTERNAL, event.message)
        return event

    async def _next_events(self, stream: asyncio.Queue, context) -> list[TokenEvent]:
        """The next event and any already queued behind it (a slow reader gets them batched)."""
        events = [await self._next_event(stream, context)]
        while not stream.empty() and events[-1].finish_reason is None:
            events.append(await self._next_event(stream, context))
        return events

    def _handle(self, request_id: str, num_tokens: int, event) -> worker_pb2.KVHandle:
        lease = self.engine.kv_lease_seconds
        num_blocks = -(-num_tokens // self.layout.block_size)
        handle = worker_pb2.KVHandle(
            handle_id=request_id, backend="grpc", source_address=self.address,
            layout=layout_to_proto(self.layout), num_tokens=num_tokens, num_blocks=num_blocks,
            lease_expires_at=time.time() + lease, transports=self.kv_transports)
        if self.nixl_endpoint is not None:
            handle.nixl.CopyFrom(nixl_endpoint_to_proto(self.nixl_endpoint))
        for name, endpoint in self.connector_endpoints.items():
            handle.connectors[name].CopyFrom(connector_endpoint_to_proto(endpoint))
        if self.cuda_ipc_endpoint is not None:
            handle.cuda_ipc.CopyFrom(cuda_ipc_endpoint_to_proto(self.cuda_ipc_endpoint))
            if len(event.kv_blocks) >= num_blocks and event.lease_deadline > 0:
                handle.cuda_ipc.block_ids.extend(event.kv_blocks[:num_blocks])
                handle.cuda_ipc.lease_deadline_monotonic = event.lease_deadline
        return handle

    async def _receive_kv(self, request, params, prompt, generated, context,
                          stream: asyncio.Queue) -> float:
        """Reserve blocks, pull the prompt's KV from the prefill worker, release it there,
        and start decoding. A pull that fails (source gone, lease expired, transfer failed)
        makes the prompt computed here (`recompute`) or fails the call UNAVAILABLE (`fail`).
        Returns the seconds the pull took (0 after a recompute)."""
        handle = request.kv_handle
        if handle.backend != "grpc" and "grpc" not in handle.transports:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"KV backend {handle.backend!r} is not available here")
        try:
            layout_from_proto(handle.layout).check_readable_by(self.layout)
        except KVLayoutMismatch as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        seq = await self._reserve(context, stream, prompt, generated, params,
                                  request.request_id, handle)
        start_block = seq.num_cached_tokens // self.layout.block_size
        block_ids = seq.block_table[start_block:handle.num_blocks]
        channel = self.peers.get(handle.source_address)
        started = time.monotonic()
        try:
            if self.kv_receiver is None:
                num_bytes = await pull_kv(channel, handle, self.layout, self.blocks, block_ids,
                                          start_block, timeout=context.time_remaining())
            else:
                num_bytes, _ = await self.kv_receiver.pull(
                    KVPeerClient(channel, self.layout), handle.source_address,
                    kv_handle_from_proto(handle), block_ids, start_block,
                    timeout=context.time_remaining())
        except (grpc.aio.AioRpcError, ValueError, KVTransportUnavailable,
                KVTransferFailed) as exc:
            if self.metrics is not None:
                self.metrics.kv_transfer_failures.inc()
            is_rpc_error = isinstance(exc, grpc.aio.AioRpcError)
            detail = exc.details() if is_rpc_error else str(exc)
            message = f"KV pull from {handle.source_address} failed: {detail}"
            if is_rpc_error and exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                # The source cannot fill our layout: a configuration error, not a transient.
                self._abort_soon(request.request_id)
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, message)
            if self.kv_pull_failure == "fail":
                self._abort_soon(request.request_id)
                await context.abort(grpc.StatusCode.UNAVAILABLE, message)
            await self._recompute(context, seq, prompt, generated, params, message)
            return 0.0
        seconds = time.monotonic() - started
        if self.metrics is not None:
            self.metrics.kv_transfer_time.observe(seconds)
            self.metrics.kv_transfer_bytes.inc(num_bytes)
        # The blocks are here: release the source's pin off the critical path (its engine
        # thread may be mid-prefill); a lost release is freed by the lease anyway.
        self._background(release_kv(channel, handle.handle_id))
        await self.engine.activate_prefilled(seq, handle.num_tokens)
        return seconds

    async def _recompute(self, context, seq, prompt, generated, params, message) -> None:
        """Replace a receiving sequence whose pull failed by one that computes the prompt here:
        one engine command aborts it (freeing its reserved blocks) and resumes the request
        under the same id, as a migrated request resumes, so the stream's tokens are those of
        an undisturbed run."""
        request_id = seq.request_id
        logger.warning("%s; recomputing %d prompt tokens of %s here", message, len(prompt),
                       request_id)
        if self.metrics is not None:
            self.metrics.kv_pull_recomputes.inc()
        await self._queue_request(context, self.engine.abort_and_resume(
            prompt, generated, params, request_id, deadline=_deadline(context)))

    async def _reserve(self, context, stream, prompt, generated, params, request_id, handle):
        """Queue the request for blocks to receive its KV into (WAITING_FOR_REMOTE_KVS) and
        wait until the engine reserved them (and a constrained request's grammar compiled);
        RESOURCE_EXHAUSTED after max_block_wait_seconds (the request leaves the queue; the
        source keeps the KV pinned for another decode worker, which the router may try)."""
        try:
            seq = await self.engine.queue_prefilled(prompt, generated, params, request_id,
                                                    deadline=_deadline(context))
        except OutOfRangeError as exc:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(exc))
        except ValueError as exc:  # a structured_output grammar known not to compile
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        event = await self._await_blocks(stream, handle)
        if event is None:
            self._abort_soon(request_id)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"no free KV blocks for {len(prompt)} tokens within "
                                f"{self.max_block_wait_seconds:g} s")
        if isinstance(event, EngineFailure):
            await context.abort(grpc.StatusCode.INTERNAL, event.message)
        if not isinstance(event, BlocksReserved):
            raise RuntimeError(f"request {request_id}: expected its blocks, got {event!r}")
        await self._await_grammar(context, seq)
        return seq

    async def _await_blocks(self, stream: asyncio.Queue, handle):
        """The stream's next event (BlocksReserved, normally) within max_block_wait_seconds;
        None when none came. Meanwhile the source's lease on the prompt's KV is renewed each
        time half of it has passed, so the KV stays pinned through a wait as long as the lease,
        and for another decode worker after a refusal."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_block_wait_seconds
        renew_in = max(MIN_LEASE_RENEWAL_SECONDS, (handle.lease_expires_at - time.time()) / 2)
        while (left := deadline - loop.time()) > 0:
            try:
                return await asyncio.wait_for(stream.get(), min(left, renew_in))
            except asyncio.TimeoutError:
                if loop.time() >= deadline:
                    return None
            lease_seconds = await self._renew_lease(handle)
            renew_in = (left if lease_seconds is None
                        else max(MIN_LEASE_RENEWAL_SECONDS, lease_seconds / 2))
        return None

    async def _renew_lease(self, handle) -> float | None:
        """LeaseKV on the source: the renewed lease's seconds, None when the handle is gone
        (its lease expired, the source restarted) or the call failed."""
        source = KVPeerClient(self.peers.get(handle.source_address), self.layout)
        try:
            return (await source.lease(handle.handle_id, 0, LEASE_RENEWAL_TIMEOUT_SECONDS)
                    ).lease_seconds
        except grpc.aio.AioRpcError as exc:
            logger.warning("LeaseKV %s failed: %s", handle.handle_id, exc.code().name)
            return None


def _deadline(context) -> float | None:
    """The call's deadline on this process's time.monotonic() clock (None: it has none), for
    the engine to drop the request once nobody waits for it."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining
