"""Server CPU per refused call for each way a grpc.aio server can refuse a streaming call.

    python bench/probes/refusal_paths.py [--bursts 5] [--burst-size 160] [--client-processes 4]

A bare grpc.aio server (its own process, no router behind it) refuses every Generate call
RESOURCE_EXHAUSTED with a `retry-after-ms` trailer, in one of these ways:

- `handler`: the registered streaming handler parses the request and aborts (as the router's
  servicer and bench/overload.py's stand-in do);
- `interceptor-stream`: a server interceptor answers with a streaming handler that aborts,
  so the request is never parsed and the service's handler never starts;
- `interceptor-unary`: the same with a unary handler (one coroutine instead of an async
  generator; the client sees the same status);
- `interceptor-status`: a unary handler that sets code, details and trailer and returns,
  instead of raising through abort().

Bursts go out from bench/burst.py's client processes, every channel dialed first; the server's
CPU seconds (from /proc) while the calls are out, divided by the calls, say what each way
costs, and so how much of a router's refusal an earlier hook could save.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket

import grpc
import numpy as np

from tandem.bench.burst import run_burst
from tandem.bench.overload import seeded_prompts
from tandem.bench.proc_stats import process_cpu_seconds
from tandem.v1 import generate_pb2

WAYS = ("handler", "interceptor-stream", "interceptor-unary", "interceptor-status")
RETRY_AFTER = (("retry-after-ms", "100"),)


async def abort_stream(request, context):
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", RETRY_AFTER)
    yield  # an async generator, as a server-streaming handler is


async def abort_unary(request, context):
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", RETRY_AFTER)


async def set_status_unary(request, context):
    context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
    context.set_details("full")
    context.set_trailing_metadata(RETRY_AFTER)


async def model_info(request, context):
    return generate_pb2.GetModelInfoResponse(model="refusal-paths")


class RefusingInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, way: str) -> None:
        self.handler = {
            "interceptor-stream": grpc.unary_stream_rpc_method_handler(abort_stream),
            "interceptor-unary": grpc.unary_unary_rpc_method_handler(abort_unary),
            "interceptor-status": grpc.unary_unary_rpc_method_handler(set_status_unary),
        }[way]

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.endswith("/Generate"):
            return self.handler
        return await continuation(handler_call_details)


def serve(way: str, port: int, ready) -> None:
    """Process entry point: refuse Generate `way` on 127.0.0.1:`port` until terminated."""
    async def main() -> None:
        interceptors = [RefusingInterceptor(way)] if way != "handler" else []
        server = grpc.aio.server(interceptors=interceptors)
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                abort_stream, request_deserializer=generate_pb2.GenerateRequest.FromString,
                response_serializer=generate_pb2.GenerateResponse.SerializeToString),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                model_info, request_deserializer=generate_pb2.GetModelInfoRequest.FromString,
                response_serializer=generate_pb2.GetModelInfoResponse.SerializeToString),
        }
        name = generate_pb2.DESCRIPTOR.services_by_name["Generate"].full_name
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()
    asyncio.run(main())


def measure(way: str, bursts: list[list[list[int]]], num_processes: int) -> str:
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = context.Process(target=serve, args=(way, port, ready), daemon=True)
    server.start()
    try:
        if not ready.wait(60):
            raise RuntimeError(f"the {way} server did not start")
        times, cpu, client_cpu = [], 0.0, 0.0
        for prompts in bursts:
            marks = {}
            outcome = run_burst(f"127.0.0.1:{port}", prompts, 64, num_processes,
                                lambda phase: marks.__setitem__(
                                    phase, process_cpu_seconds(server.pid)))
            if len(outcome.refused) != len(prompts):
                raise RuntimeError(f"{way}: not every call was refused: {outcome.calls[:3]}")
            times += [call.elapsed_ms for call in outcome.refused]
            cpu += marks["end"] - marks["start"]
            client_cpu += outcome.client_cpu_seconds
    finally:
        server.terminate()
        server.join(10)
    return (f"{way:<20} CPU {cpu / len(times) * 1000:.3f} ms per refusal (clients "
            f"{client_cpu / len(times) * 1000:.3f}); client ms p50 "
            f"{np.percentile(times, 50):.1f} p99 {np.percentile(times, 99):.1f}; "
            f"load {os.getloadavg()[0]:.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bursts", type=int, default=5)
    p.add_argument("--burst-size", type=int, default=160)
    p.add_argument("--client-processes", type=int, default=4)
    args = p.parse_args()
    bursts = [seeded_prompts(args.burst_size, 32, 49152, index) for index in range(args.bursts)]
    for way in WAYS:
        print(measure(way, bursts, args.client_processes), flush=True)


if __name__ == "__main__":
    main()
