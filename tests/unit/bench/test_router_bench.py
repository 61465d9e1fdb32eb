"""The router microbenchmark's parts: the fake worker over real gRPC, the latency pairing."""
from __future__ import annotations

import asyncio

import grpc
import numpy as np
from helpers.standin_server import serve

from tandem.bench.router import added_latencies
from tandem.bench.router_fakes import FakeWorker
from tandem.v1 import generate_pb2, worker_pb2, worker_pb2_grpc


def test_fake_worker_streams_max_tokens_in_order_and_records_each_send():
    worker = FakeWorker(token_ids=list(range(100, 110)), step_seconds=0.001, model="m")

    def register(server):
        worker.register(server)
        asyncio.get_running_loop().create_task(worker.run_steps())

    requests = [worker_pb2.DecodeStreamRequest(start=worker_pb2.DecodeRequest(
        request_id=f"client-{i}.5f1e", params=worker_pb2.EngineParams(max_tokens=25 + i)))
        for i in range(2)]
    with serve(register) as address:
        with grpc.insecure_channel(address) as channel:
            call = worker_pb2_grpc.WorkerStub(channel).DecodeStream(iter(requests), timeout=10)
            updates: dict[str, list] = {"client-0.5f1e": [], "client-1.5f1e": []}
            for message in call:
                for update in message.updates:
                    updates[update.request_id].append(update.response)
                if all(u and u[-1].finish_reason for u in updates.values()):
                    call.cancel()
                    break
    sends = worker.take_sends()
    assert sorted(sends) == ["client-0", "client-1"]  # the router's suffix dropped
    for i in range(2):
        messages = updates[f"client-{i}.5f1e"]
        token_ids = [t for m in messages for t in m.token_ids]
        assert len(token_ids) == 25 + i and set(token_ids) <= set(range(100, 110))
        assert all(b == 100 + (a - 100 + 1) % 10 for a, b in zip(token_ids, token_ids[1:]))
        assert messages[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert all(m.finish_reason == 0 for m in messages[:-1])
        assert [n for _, n in sends[f"client-{i}"]] == [len(m.token_ids) for m in messages]


def test_added_latency_pairs_the_kth_token_sent_with_the_kth_received():
    sends = {"r": [(1.0, 2), (2.0, 1)]}  # tokens 0, 1 sent at 1.0; token 2 at 2.0
    received = {"r": [(1.5, 1), (2.5, 2)], "lost": [(3.0, 1)]}  # token 0 at 1.5; 1, 2 at 2.5
    assert np.allclose(sorted(added_latencies(sends, received, 0.0, 10.0)), [0.5, 0.5, 1.5])
    assert np.allclose(added_latencies(sends, received, 2.0, 10.0), [1.5, 0.5])


def test_fake_worker_records_each_tokens_step_time_no_later_than_its_send():
    worker = FakeWorker(token_ids=list(range(100, 110)), step_seconds=0.001, model="m")

    def register(server):
        worker.register(server)
        asyncio.get_running_loop().create_task(worker.run_steps())

    request = worker_pb2.DecodeStreamRequest(start=worker_pb2.DecodeRequest(
        request_id="client-0.5f1e", params=worker_pb2.EngineParams(max_tokens=30)))
    with serve(register) as address:
        with grpc.insecure_channel(address) as channel:
            call = worker_pb2_grpc.WorkerStub(channel).DecodeStream(iter([request]), timeout=10)
            for message in call:
                if any(u.response.finish_reason for u in message.updates):
                    call.cancel()
                    break
    sends, steps = worker.take_sends()["client-0"], worker.take_steps()["client-0"]
    assert [n for _, n in steps] == [1] * 30
    step_times = [t for t, _ in steps]
    assert step_times == sorted(step_times) and len(set(step_times)) == 30  # one per step
    send_times = np.repeat(*map(np.array, zip(*sends)))
    assert (np.array(step_times) <= send_times).all()


def test_fake_worker_serves_a_decode_call_per_request_with_the_same_walk():
    worker = FakeWorker(token_ids=list(range(100, 110)), step_seconds=0.001, model="m")

    def register(server):
        worker.register(server)
        asyncio.get_running_loop().create_task(worker.run_steps())

    request = worker_pb2.DecodeRequest(request_id="client-0.5f1e",
                                       params=worker_pb2.EngineParams(max_tokens=23))
    with serve(register) as address:
        with grpc.insecure_channel(address) as channel:
            messages = list(worker_pb2_grpc.WorkerStub(channel).Decode(request, timeout=10))
    token_ids = [t for m in messages for t in m.token_ids]
    assert len(token_ids) == 23
    assert all(b == 100 + (a - 100 + 1) % 10 for a, b in zip(token_ids, token_ids[1:]))
    assert messages[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert [n for _, n in worker.take_sends()["client-0"]] == [len(m.token_ids) for m in messages]
    assert len(worker.take_steps()["client-0"]) == 23
