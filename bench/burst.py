"""A burst of Generate calls sent at once by several client processes, each call timed from
its own send.

One Python process starting hundreds of calls is itself the bottleneck of a burst: its one
event loop sends the calls one after another and then handles every answer in turn, so a
call's measured time includes the client's work for all the calls before it. Here each of
`num_processes` children dials its share of the calls (one channel per call, warmed with
GetModelInfo), waits for the others, and on a common start sends its share; every call
records `time.monotonic()` (CLOCK_MONOTONIC: one clock for every process on the host) just
before it is handed to gRPC and again when its status arrives, and each child reports its
CPU seconds over the calls (a refusal costs the client about as much CPU as the server).
Prompts are token ids or text.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import time
from dataclasses import dataclass

import grpc

from tandem.client import AsyncTandemClient

__all__ = ["CallOutcome", "BurstOutcome", "run_burst"]
START_TIMEOUT_SECONDS = 120.0


@dataclass(frozen=True)
class CallOutcome:
    """One call of a burst: when it was sent and ended (time.monotonic()), its status code
    name ("OK" when it completed) and, for a completed one, its client-side TPOT."""
    sent: float
    ended: float
    code: str
    details: str = ""
    retry_after_ms: int | None = None
    tpot_seconds: float | None = None

    @property
    def elapsed_ms(self) -> float:
        return (self.ended - self.sent) * 1000


@dataclass(frozen=True)
class BurstOutcome:
    calls: list[CallOutcome]
    client_cpu_seconds: float = 0.0  # the client processes' CPU from the start to the last end

    @property
    def refused(self) -> list[CallOutcome]:
        return [c for c in self.calls if c.code == "RESOURCE_EXHAUSTED"]

    @property
    def completed(self) -> list[CallOutcome]:
        return [c for c in self.calls if c.code == "OK"]

    @property
    def failed(self) -> list[CallOutcome]:
        return [c for c in self.calls if c.code not in ("OK", "RESOURCE_EXHAUSTED")]

    @property
    def send_span_ms(self) -> float:
        """From the first call sent to the last: how long issuing the burst took."""
        sent = [c.sent for c in self.calls]
        return (max(sent) - min(sent)) * 1000 if sent else 0.0

    @property
    def refusal_span_ms(self) -> float:
        """From the first call sent to the last refusal received: how long the server and
        the clients took to get through the burst's excess."""
        if not self.refused:
            return 0.0
        return (max(c.ended for c in self.refused) - min(c.sent for c in self.calls)) * 1000


def run_burst(address: str, prompts: list[str | list[int]], max_tokens: int,
              num_processes: int = 4, on_phase=None) -> BurstOutcome:
    """Sends one call per prompt, split over `num_processes` client processes that start
    together; returns every call's outcome. `on_phase("start")` runs once every channel is
    dialed, just before the calls go out; `on_phase("end")` once every call has ended, before
    any channel closes (so a caller can read the server's CPU time over the calls alone)."""
    num_processes = max(1, min(num_processes, len(prompts)))
    context = multiprocessing.get_context("spawn")
    start, end = context.Barrier(num_processes + 1), context.Barrier(num_processes + 1)
    results = context.Queue()
    shares = [prompts[index::num_processes] for index in range(num_processes)]
    children = [context.Process(target=_client_process,
                                args=(address, share, max_tokens, start, end, results),
                                daemon=True)
                for share in shares]
    for child in children:
        child.start()
    calls: list[CallOutcome] = []
    client_cpu_seconds = 0.0
    try:
        start.wait(START_TIMEOUT_SECONDS)  # every child has dialed its channels
        if on_phase is not None:
            on_phase("start")
        start.wait(START_TIMEOUT_SECONDS)  # the calls go out
        for _ in children:
            share_calls, share_cpu_seconds = results.get(timeout=START_TIMEOUT_SECONDS + 600)
            calls += share_calls
            client_cpu_seconds += share_cpu_seconds
        if on_phase is not None:
            on_phase("end")
        end.wait(START_TIMEOUT_SECONDS)
    finally:
        for child in children:
            child.join(10)
            if child.is_alive():
                child.kill()
    return BurstOutcome(calls, client_cpu_seconds)


def _client_process(address: str, prompts: list[str | list[int]], max_tokens: int, start, end,
                    results) -> None:
    asyncio.run(_send_share(address, prompts, max_tokens, start, end, results))


async def _send_share(address: str, prompts: list[str | list[int]], max_tokens: int, start,
                      end, results) -> None:
    """Dial, meet the others at `start` (twice: dialed, then go), send, report, meet them at
    `end`, close."""
    clients = [AsyncTandemClient(address, timeout=600) for _ in prompts]
    try:
        await asyncio.gather(*(client.model_info() for client in clients))
        await asyncio.to_thread(start.wait, START_TIMEOUT_SECONDS)
        await asyncio.to_thread(start.wait, START_TIMEOUT_SECONDS)
        started_cpu = time.process_time()
        calls = await asyncio.gather(*(_one_call(client, prompt, max_tokens)
                                       for client, prompt in zip(clients, prompts)))
        results.put((list(calls), time.process_time() - started_cpu))
        await asyncio.to_thread(end.wait, START_TIMEOUT_SECONDS)
    finally:
        await asyncio.gather(*(client.close() for client in clients))


async def _one_call(client: AsyncTandemClient, prompt: str | list[int],
                    max_tokens: int) -> CallOutcome:
    sent = time.monotonic()
    try:
        result = await client.generate(prompt, max_tokens=max_tokens, temperature=0.0,
                                       ignore_eos=True)
    except grpc.RpcError as exc:
        ended = time.monotonic()
        metadata = dict(exc.trailing_metadata() or ())
        retry_after = metadata.get("retry-after-ms")
        return CallOutcome(sent, ended, exc.code().name, exc.details() or "",
                           int(retry_after) if retry_after is not None else None)
    return CallOutcome(sent, time.monotonic(), "OK", tpot_seconds=result.client_tpot_seconds)
