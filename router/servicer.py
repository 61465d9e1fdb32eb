"""The public Generate service: admit, validate, tokenize, then relay a RequestFlow.

`add_generate_service` registers it with a request parser that turns undecodable bytes (a
truncated message, a string field that is not UTF-8) into INVALID_ARGUMENT instead of the
UNKNOWN that a failing deserializer would give.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Protocol

import grpc
from google.protobuf.message import DecodeError

from tandem.common.logging import get_logger
from tandem.common.metrics import RouterMetrics
from tandem.router.admission import Admission, AtCapacity
from tandem.router.request_flow import RequestContext, RequestFlow, StallLimits
from tandem.router.tokenization import ModelFrontend
from tandem.router.validation import (RequestError, check_request, resolve_params,
                                      structured_output)
from tandem.router.worker_pool import WorkerPool
from tandem.v1 import generate_pb2, generate_pb2_grpc

logger = get_logger(__name__)
MAX_REQUEST_ID_PREFIX_CHARS = 64


def add_generate_service(servicer: GenerateServicer, server) -> None:
    """generate_pb2_grpc.add_GenerateServicer_to_server, with Generate's bytes parsed by
    `parse_generate_request`."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=parse_generate_request,
            response_serializer=generate_pb2.GenerateResponse.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo,
            request_deserializer=generate_pb2.GetModelInfoRequest.FromString,
            response_serializer=generate_pb2.GetModelInfoResponse.SerializeToString),
    }
    name = generate_pb2.DESCRIPTOR.services_by_name["Generate"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


def parse_generate_request(data: bytes) -> generate_pb2.GenerateRequest | RequestError:
    """The request, or the INVALID_ARGUMENT error to answer it with."""
    try:
        return generate_pb2.GenerateRequest.FromString(data)
    except DecodeError as exc:
        return RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"the request is not a valid tandem.v1.GenerateRequest ({exc}): "
                            "malformed protobuf, or a string field that is not UTF-8")


def worker_request_id(client_request_id: str) -> str:
    """An id no other call has: the client's id (shortened) for grepping logs, plus a UUID."""
    unique = uuid.uuid4().hex
    prefix = client_request_id[:MAX_REQUEST_ID_PREFIX_CHARS]
    return f"{prefix}.{unique}" if prefix else unique


class GenerateServicer(generate_pb2_grpc.GenerateServicer):
    def __init__(self, frontend: ModelFrontend, pool: WorkerPool, admission: Admission,
                 metrics: RouterMetrics, stall: StallLimits = StallLimits(),
                 migration_limit: int = 3) -> None:
        if migration_limit < 0:
            raise ValueError(f"migration_limit={migration_limit} must be >= 0")
        self.frontend = frontend
        self.stall = stall
        self.migration_limit = migration_limit
        self.pool = pool
        self.admission = admission
        self.metrics = metrics
        self.is_draining = False
        metrics.num_requests_running.set_function(lambda: admission.num_running)
        metrics.num_requests_waiting.set_function(lambda: admission.num_waiting)
        for worker in pool.workers:
            self._export_health(worker)
        pool.on_added.append(self._export_health)

    def _export_health(self, worker) -> None:
        self.metrics.worker_healthy.labels(worker=worker.address, role=worker.role).set_function(
            lambda: 1.0 if worker.is_healthy and not worker.is_removed else 0.0)

    async def GetModelInfo(self, request, context):
        return self.frontend.model_info()

    async def Generate(self, request, context):
        try:
            if isinstance(request, RequestError):  # undecodable bytes
                self.metrics.requests_finished.labels(status=request.code.name).inc()
                raise request
            async with aclosing(self.stream(request, context)) as responses:
                async for response in responses:
                    yield response
        except RequestError as exc:
            await context.abort(exc.code, exc.message, exc.trailing_metadata)

    async def stream(self, request: generate_pb2.GenerateRequest,
                     deadline: Deadline) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """One request's responses, whatever the transport: admission first (a full router
        refuses before any other work), then validation, tokenization, a running slot and
        the RequestFlow. Raises RequestError for a request that fails; closing or cancelling
        the generator (a client that went away) aborts the request on every worker it
        reached. `deadline` is the grpc context, or any object whose time_remaining() gives
        the seconds left (None: no deadline)."""
        arrival = time.monotonic()
        try:
            if self.is_draining:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "router is shutting down")
            with self.admission.place():
                prepared = await self._prepare(request, arrival)
                async with self.admission.slot():
                    remaining = deadline.time_remaining()
                    if remaining is not None and remaining <= 0:
                        raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                           "the deadline passed while the request waited for "
                                           "admission")
                    prepared.queue_seconds = time.monotonic() - arrival
                    self.metrics.queue_time.observe(prepared.queue_seconds)
                    self.metrics.prompt_tokens.inc(len(prepared.prompt_token_ids))
                    flow = RequestFlow(self.pool, self.frontend.tokenizer, prepared, deadline,
                                       self.metrics, self.stall, self.migration_limit)
                    async with aclosing(flow.responses()) as responses:
                        async for response in responses:
                            yield response
        except RequestError as exc:
            if isinstance(exc, AtCapacity):
                self.metrics.refusal_time.observe(time.monotonic() - arrival)
            self.metrics.requests_finished.labels(status=exc.code.name).inc()
            raise
        except (asyncio.CancelledError, GeneratorExit):  # client cancel, disconnect, deadline
            remaining = deadline.time_remaining()
            status = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 \
                else "CANCELLED"
            self.metrics.requests_finished.labels(status=status).inc()
            raise

    async def _prepare(self, request: generate_pb2.GenerateRequest,
                       arrival: float) -> RequestContext:
        """The request checked, tokenized (off the event loop) and resolved; RequestError
        names what is wrong with it."""
        worker_id = worker_request_id(request.request_id)
        limits = self.frontend.limits
        check_request(request, limits)
        forcing = self.frontend.tool_call_grammar(request.chat)
        if forcing is not None:  # tool_choice required or named: the grammar makes the call
            request.structured_output.grammar = forcing
        spec = structured_output(request)
        if spec is not None:
            problem = await self.frontend.structured_output_error(spec)
            if problem is not None:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, problem)
        started = time.monotonic()
        prompt = await self.frontend.prompt_token_ids(request)
        self.metrics.tokenization_time.observe(time.monotonic() - started)
        params = resolve_params(request, len(prompt), limits)
        return RequestContext(request.request_id or worker_id, worker_id, prompt, params,
                              list(request.stop.stop), arrival, queue_seconds=0.0)


class Deadline(Protocol):
    """What the request path needs of a call: the seconds it has left (None: no limit)."""

    def time_remaining(self) -> float | None: ...
