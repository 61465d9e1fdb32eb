"""The floor under the router's cost per streamed message: a grpc.aio server that does nothing
but stream one small message per open stream per step, as the router's client hop does at one
token per chunk.

    python -m tandem.bench.grpc_floor                  # 64 and 512 streams, 2000 messages/s
    python -m tandem.bench.grpc_floor --uvloop         # the same server on uvloop

Two processes on 127.0.0.1: the server (a Generate servicer whose streams each send a
GenerateResponse the size of a one-token chunk whenever the step loop sets their event) and
one client process reading every stream. It reports the server's CPU time (user + system,
every thread, from getrusage) per message sent in the measured window: what one Generate
stream's write costs in grpc.aio alone, before any router logic.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import resource
import socket
import sys

import grpc

from tandem.v1 import generate_pb2, generate_pb2_grpc


class _Streams(generate_pb2_grpc.GenerateServicer):
    def __init__(self) -> None:
        self.events: list[asyncio.Event] = []

    async def Generate(self, request, context):  # noqa: N802 (gRPC's naming)
        event = asyncio.Event()
        self.events.append(event)
        while True:
            await event.wait()
            event.clear()
            yield generate_pb2.GenerateResponse(chunk=generate_pb2.Chunk(text=" token",
                                                                         token_ids=[1234]))


async def _serve(port: int, step_seconds: float, warmup: float, duration: float,
                 results) -> None:
    server = grpc.aio.server()
    streams = _Streams()
    generate_pb2_grpc.add_GenerateServicer_to_server(streams, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    results.send("started")

    async def step_forever() -> None:
        while True:
            await asyncio.sleep(step_seconds)
            for event in streams.events:
                event.set()

    steps = asyncio.create_task(step_forever())  # noqa: F841 (runs until the process ends)
    await asyncio.sleep(warmup)
    before = resource.getrusage(resource.RUSAGE_SELF)
    await asyncio.sleep(duration)
    after = resource.getrusage(resource.RUSAGE_SELF)
    results.send((after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime))
    await asyncio.Event().wait()  # serves until terminated, after the client has gone


def _run_server(port: int, step_seconds: float, warmup: float, duration: float,
                use_uvloop: bool, results) -> None:
    main = _serve(port, step_seconds, warmup, duration, results)
    if use_uvloop:
        import uvloop

        uvloop.run(main)
    else:
        asyncio.run(main)


async def _read(port: int, num_streams: int, warmup: float, duration: float) -> int:
    num_messages = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)

        async def read_one() -> None:
            nonlocal num_messages
            async for _ in stub.Generate(generate_pb2.GenerateRequest()):
                num_messages += 1

        readers = [asyncio.create_task(read_one()) for _ in range(num_streams)]
        await asyncio.sleep(warmup)
        before = num_messages
        await asyncio.sleep(duration)
        received = num_messages - before
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    return received


def _run_client(port: int, num_streams: int, warmup: float, duration: float, results) -> None:
    results.send(asyncio.run(_read(port, num_streams, warmup, duration)))


def measure(num_streams: int, rate: float, warmup: float, duration: float,
            use_uvloop: bool) -> tuple[float, float]:
    """(messages/s, server CPU microseconds per message)."""
    context = multiprocessing.get_context("spawn")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server_results, server_end = context.Pipe(duplex=False)
    server = context.Process(target=_run_server, daemon=True, args=(
        port, num_streams / rate, warmup + 1.0, duration, use_uvloop, server_end))
    server.start()
    server_results.recv()
    client_results, client_end = context.Pipe(duplex=False)
    client = context.Process(target=_run_client, daemon=True,
                             args=(port, num_streams, warmup + 1.0, duration, client_end))
    client.start()
    num_messages = client_results.recv()
    cpu_seconds = server_results.recv()
    client.join(10)
    server.terminate()
    server.join(10)
    return num_messages / duration, cpu_seconds / max(num_messages, 1) * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.grpc_floor",
                                description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")],
                   default=[64, 512], help="concurrent streams per level (default 64,512)")
    p.add_argument("--rate", type=float, default=2000.0,
                   help="messages/s over all streams (default 2000, as the router "
                        "microbenchmark's paced phase)")
    p.add_argument("--duration", type=float, default=8.0, help="measured seconds per level")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds first")
    p.add_argument("--uvloop", action="store_true",
                   help="run the server on uvloop (pip install uvloop; not a tandem dependency)")
    args = p.parse_args(argv)
    print("| streams | messages/s | server CPU us/message | messages per server CPU-second |")
    print("|---:|---:|---:|---:|")
    for num_streams in args.streams:
        rate, us_per_message = measure(num_streams, args.rate, args.warmup, args.duration,
                                       args.uvloop)
        print(f"| {num_streams} | {rate:,.0f} | {us_per_message:.1f} | "
              f"{1e6 / us_per_message:,.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
