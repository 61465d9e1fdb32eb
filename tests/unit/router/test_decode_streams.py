"""DecodeStream (router side): many requests over one gRPC stream to a stand-in worker; each
request reads its own tokens, its own error, and the stream's failure."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from helpers.standin_server import serve

from tandem.router.decode_streams import DecodeStream, WorkerStatusError
from tandem.v1 import generate_pb2, worker_pb2, worker_pb2_grpc


class ScriptedWorker(worker_pb2_grpc.WorkerServicer):
    """Each request id says what its request does: "tokens-<n>-<first>" streams n tokens from
    <first> one message at a time, "refused" ends with OUT_OF_RANGE, "break" fails the whole
    stream UNAVAILABLE."""

    def __init__(self) -> None:
        self.num_streams = 0

    async def DecodeStream(self, request_iterator, context):  # noqa: N802 (gRPC's naming)
        self.num_streams += 1
        outbox: asyncio.Queue = asyncio.Queue()

        async def run(request_id: str) -> None:
            if request_id == "refused":
                await outbox.put(worker_pb2.DecodeUpdate(
                    request_id=request_id, status_code=grpc.StatusCode.OUT_OF_RANGE.value[0],
                    status_message="prompt too long"))
                return
            if request_id == "break":
                await outbox.put(None)
                return
            _, num_tokens, first = request_id.split("-")
            for index in range(int(num_tokens)):
                await asyncio.sleep(0.01)
                is_last = index == int(num_tokens) - 1
                await outbox.put(worker_pb2.DecodeUpdate(
                    request_id=request_id, response=worker_pb2.DecodeResponse(
                        token_ids=[int(first) + index],
                        finish_reason=generate_pb2.FINISH_REASON_LENGTH if is_last else 0)))

        async def read() -> None:
            async for message in request_iterator:
                asyncio.create_task(run(message.start.request_id))

        reader = asyncio.create_task(read())
        try:
            while True:
                update = await outbox.get()
                if update is None:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "worker went away")
                yield worker_pb2.DecodeStreamResponse(updates=[update])
        finally:
            reader.cancel()


def run_against_worker(scenario) -> object:
    worker = ScriptedWorker()
    with serve(lambda server: worker_pb2_grpc.add_WorkerServicer_to_server(worker,
                                                                           server)) as address:
        async def main():
            async with grpc.aio.insecure_channel(address) as channel:
                stream = DecodeStream()
                try:
                    return await scenario(stream, worker_pb2_grpc.WorkerStub(channel), worker)
                finally:
                    stream.close()
        return asyncio.run(asyncio.wait_for(main(), 30))


def start(stream: DecodeStream, stub, request_id: str):
    return stream.start(stub, worker_pb2.DecodeRequest(request_id=request_id), 30.0)


async def read_to_end(receiver) -> list[int]:
    token_ids = []
    while True:
        messages = await receiver.read()
        if messages is grpc.aio.EOF:
            return token_ids + ["EOF"]
        token_ids += [t for m in messages for t in m.token_ids]
        if messages[-1].finish_reason:
            receiver.close()
            return token_ids


def test_requests_on_one_stream_each_get_their_own_tokens():
    async def scenario(stream, stub, worker):
        a, b = start(stream, stub, "tokens-5-100"), start(stream, stub, "tokens-8-200")
        tokens = await asyncio.gather(read_to_end(a), read_to_end(b))
        c = start(stream, stub, "tokens-3-300")  # the same stream carries the next one too
        return tokens, await read_to_end(c), worker.num_streams

    tokens, later, num_streams = run_against_worker(scenario)
    assert tokens == [list(range(100, 105)), list(range(200, 208))]
    assert later == [300, 301, 302] and num_streams == 1


def test_messages_that_arrive_between_reads_come_in_one_read():
    async def scenario(stream, stub, worker):
        receiver = start(stream, stub, "tokens-6-10")
        await asyncio.sleep(0.3)  # a client write that takes long: every token arrives
        return await receiver.read()

    messages = run_against_worker(scenario)
    assert [t for m in messages for t in m.token_ids] == list(range(10, 16))


def test_a_request_error_ends_that_request_only():
    async def scenario(stream, stub, worker):
        ok, refused = start(stream, stub, "tokens-4-1"), start(stream, stub, "refused")
        with pytest.raises(WorkerStatusError) as error:
            await refused.read()
        return error.value, await read_to_end(ok)

    error, tokens = run_against_worker(scenario)
    assert error.code() == grpc.StatusCode.OUT_OF_RANGE and error.details() == "prompt too long"
    assert tokens == [1, 2, 3, 4]


def test_a_failed_stream_fails_every_request_on_it_and_the_next_request_opens_a_new_one():
    async def scenario(stream, stub, worker):
        first, second = start(stream, stub, "tokens-500-0"), start(stream, stub, "tokens-500-1000")
        await first.read()
        start(stream, stub, "break")
        codes = []
        for receiver in (first, second):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                while True:
                    await receiver.read()
            codes.append(error.value.code())
        after = start(stream, stub, "tokens-2-7")
        return codes, await read_to_end(after), worker.num_streams

    codes, tokens, num_streams = run_against_worker(scenario)
    assert codes == [grpc.StatusCode.UNAVAILABLE] * 2
    assert tokens == [7, 8] and num_streams == 2
