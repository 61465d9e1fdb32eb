"""The public Generate service: validate, tokenize, admit, then relay a RequestFlow."""
from __future__ import annotations

import asyncio
import time
import uuid

import grpc

from tandem.common.logging import get_logger
from tandem.common.metrics import RouterMetrics
from tandem.router.admission import Admission
from tandem.router.request_flow import RequestContext, RequestFlow
from tandem.router.tokenization import ModelFrontend
from tandem.router.validation import RequestError, check_request, resolve_params
from tandem.router.worker_pool import WorkerPool
from tandem.v1 import generate_pb2_grpc

logger = get_logger(__name__)


class GenerateServicer(generate_pb2_grpc.GenerateServicer):
    def __init__(self, frontend: ModelFrontend, pool: WorkerPool, admission: Admission,
                 metrics: RouterMetrics) -> None:
        self.frontend = frontend
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
        arrival = time.monotonic()
        request_id = request.request_id or uuid.uuid4().hex
        try:
            if self.is_draining:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "router is shutting down")
            limits = self.frontend.limits
            check_request(request, limits)
            started = time.monotonic()
            prompt = await self.frontend.prompt_token_ids(request)
            self.metrics.tokenization_time.observe(time.monotonic() - started)
            params = resolve_params(request, len(prompt), limits)
            async with self.admission.slot():
                queue_seconds = time.monotonic() - arrival
                self.metrics.queue_time.observe(queue_seconds)
                self.metrics.prompt_tokens.inc(len(prompt))
                flow = RequestFlow(self.pool, self.frontend.tokenizer, RequestContext(
                    request_id, prompt, params, list(request.stop.stop), arrival,
                    queue_seconds), context, self.metrics)
                async for response in flow.responses():
                    yield response
        except RequestError as exc:
            self.metrics.requests_finished.labels(status=exc.code.name).inc()
            await context.abort(exc.code, exc.message)
        except asyncio.CancelledError:  # client cancel, disconnect or deadline
            remaining = context.time_remaining()
            status = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 \
                else "CANCELLED"
            self.metrics.requests_finished.labels(status=status).inc()
            raise
