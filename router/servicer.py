"""The public Generate service: validate, tokenize, admit, then relay a RequestFlow."""
from __future__ import annotations

import time
import uuid

import grpc

from tandem.common.logging import get_logger
from tandem.router.admission import Admission
from tandem.router.request_flow import RequestContext, RequestFlow
from tandem.router.tokenization import ModelFrontend
from tandem.router.validation import RequestError, check_request, resolve_params
from tandem.router.worker_pool import WorkerPool
from tandem.v1 import generate_pb2_grpc

logger = get_logger(__name__)


class GenerateServicer(generate_pb2_grpc.GenerateServicer):
    def __init__(self, frontend: ModelFrontend, pool: WorkerPool, admission: Admission) -> None:
        self.frontend = frontend
        self.pool = pool
        self.admission = admission
        self.is_draining = False

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
            prompt = await self.frontend.prompt_token_ids(request)
            params = resolve_params(request, len(prompt), limits)
            async with self.admission.slot():
                flow = RequestFlow(self.pool, self.frontend.tokenizer, RequestContext(
                    request_id, prompt, params, list(request.stop.stop), arrival,
                    time.monotonic() - arrival), context)
                async for response in flow.responses():
                    yield response
        except RequestError as exc:
            await context.abort(exc.code, exc.message)
