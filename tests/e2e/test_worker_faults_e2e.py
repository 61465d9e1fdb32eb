"""Worker-side reliability on a real worker process: cancelled, deadlined and aborted requests
stop generating and free their blocks, a duplicate request id leaves the live request alone,
and SIGTERM ends the process (alone and under `tandem up`)."""
from __future__ import annotations

import signal
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.client import generate, request, worker_load
from helpers.processes import (child_pids, free_port, start, start_up, stop, wait_gone,
                               wait_serving, wait_until)
from prometheus_client.parser import text_string_to_metric_families

from tandem import SamplingParams
from tandem.common.convert import engine_params_to_proto
from tandem.v1 import worker_pb2, worker_pb2_grpc

# ~400 tokens per stream keeps the engine stepping for many seconds on CPU.
BUSY = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


def start_worker(model, log_dir, role: str = "both", extra: list[str] = ()):
    """A worker process with its /metrics endpoint; returns (process, metrics address)."""
    port, metrics_port = free_port(), free_port()
    worker = start(f"{role}-worker", ["tandem.workers.server", "--role", role, "--model",
                                      str(model), "--port", str(port), "--dtype", "float32",
                                      "--metrics-port", str(metrics_port),
                                      "--metrics-host", "127.0.0.1", *extra], port, log_dir)
    try:
        wait_serving([worker])
    except Exception:
        stop([worker])
        raise
    return worker, f"127.0.0.1:{metrics_port}"



def is_idle(address: str) -> bool:
    load = worker_load(address)
    return load.num_running == 0 and load.num_waiting == 0 and load.kv_usage == 0


def finished_by_status(metrics_address: str) -> dict[str, float]:
    """The worker's tandem:requests_finished counter, by status label."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {sample.labels["status"]: sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "tandem:requests_finished"
            for sample in family.samples if sample.name.endswith("_total")}


def decode_request(request_id: str, prompt: list[int], params: SamplingParams = BUSY):
    return worker_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt,
                                    params=engine_params_to_proto(params))


@pytest.fixture(scope="module")
def worker(checkpoint, tmp_path_factory):
    process, metrics = start_worker(checkpoint("llama").path,
                                    tmp_path_factory.mktemp("worker_logs"))
    process.metrics_address = metrics
    yield process
    stop([process])


def read_all(call, outcomes: list) -> None:
    try:
        for _ in call:
            pass
        outcomes.append(grpc.StatusCode.OK)
    except grpc.RpcError as exc:
        outcomes.append(exc.code())


@pytest.mark.slow
def test_cancelled_deadlined_and_aborted_streams_stop_generating(worker):
    """As a router ends a stream (its deadline passes, or the client goes away, and an Abort
    follows at once), the handler is cancelled twice while the engine thread is busy stepping:
    every request must still leave the engine. Nothing runs and no KV block is held a few
    seconds later, long before max_tokens would be reached."""
    num_streams = 32
    deadline_seconds = 2.0
    outcomes: list = []
    before = finished_by_status(worker.metrics_address)
    with grpc.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        started = time.monotonic()
        calls, threads = [], []
        for i in range(num_streams):
            timeout = deadline_seconds if i % 2 else 60
            calls.append(stub.Decode(decode_request(f"r{i}", [1 + i % 7] * (20 + i)),
                                     timeout=timeout))
            threads.append(threading.Thread(target=read_all, args=(calls[-1], outcomes),
                                            daemon=True))
            threads[-1].start()
        wait_until(lambda: worker_load(worker.address).num_running > 0, timeout=20)
        health = health_pb2_grpc.HealthStub(channel)  # answers while the engine is busy
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
            health_pb2.HealthCheckResponse.SERVING
        # Odd streams: Aborts follow their deadline, as a router's do.
        time.sleep(max(0.0, started + deadline_seconds - time.monotonic()))
        aborts = [stub.Abort.future(worker_pb2.AbortRequest(request_id=f"r{i}"), timeout=10)
                  for i in range(1, num_streams, 2)]
        # Even streams: the client cancels, then aborts at once.
        for i in range(0, num_streams, 2):
            calls[i].cancel()
            aborts.append(stub.Abort.future(worker_pb2.AbortRequest(request_id=f"r{i}"),
                                            timeout=10))
        for abort in aborts:
            abort.result()
        for thread in threads:
            thread.join(timeout=30)
        assert grpc.StatusCode.OK not in outcomes and len(outcomes) == num_streams

    def num_ended(status: str) -> float:
        return finished_by_status(worker.metrics_address).get(status, 0) - before.get(status, 0)

    wait_until(lambda: is_idle(worker.address) and sum(
        num_ended(status) for status in ("abort", "deadline", "length")) == num_streams,
        timeout=60)
    # A leaked request runs on to max_tokens and ends "length" instead of "abort".
    assert num_ended("length") == 0


@pytest.mark.slow
def test_deadlined_and_aborted_prefills_leave_nothing_pinned(checkpoint, tmp_path):
    """Prefills (small chunks keep the engine busy for a while) whose deadline passes and
    that are then aborted, as a router does: none of them is left to finish and pin KV."""
    prefill, metrics = start_worker(checkpoint("llama").path, tmp_path, role="prefill",
                                    extra=["--max-num-batched-tokens", "8"])
    num_prefills = 24
    try:
        before = finished_by_status(metrics)
        with grpc.insecure_channel(prefill.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            calls = [stub.Prefill.future(worker_pb2.PrefillRequest(
                request_id=f"p{i}", prompt_token_ids=[1 + (i + j) % 300 for j in range(480)],
                params=engine_params_to_proto(BUSY), keep_kv=True), timeout=0.3)
                for i in range(num_prefills)]
            codes = []
            aborts = []
            for i, call in enumerate(calls):  # as each ends, a router aborts a failed one
                codes.append(call.exception().code() if call.exception()
                             else grpc.StatusCode.OK)
                if codes[-1] != grpc.StatusCode.OK:
                    aborts.append(stub.Abort.future(worker_pb2.AbortRequest(
                        request_id=f"p{i}"), timeout=10))
            for abort in aborts:
                abort.result()
        num_done = codes.count(grpc.StatusCode.OK)  # finished in time: pinned, legitimately
        assert num_done < num_prefills // 2, codes

        def num_ended() -> float:
            after = finished_by_status(metrics)
            return sum(after.get(s, 0) - before.get(s, 0) for s in after)

        def is_quiet() -> bool:
            load = worker_load(prefill.address)
            return load.num_running == 0 and load.num_waiting == 0
        wait_until(lambda: is_quiet() and num_ended() == num_prefills, timeout=60)
        # A prefill that finishes on the worker as its caller's deadline passes ends "pinned"
        # there while the caller sees DEADLINE_EXCEEDED; the caller's abort then releases it.
        num_pinned_ends = finished_by_status(metrics).get("pinned", 0) - before.get("pinned", 0)
        assert num_done <= num_pinned_ends <= num_done + len(aborts)
        # A prefill whose abort was lost runs on and keeps its KV pinned.
        wait_until(lambda: worker_load(prefill.address).num_pinned == num_done, timeout=10)
    finally:
        stop([prefill])


def test_load_names_the_instance_and_which_asked_about_requests_are_held(worker):
    """What a router's probe reads before a worker rejoins: the process's instance id (the
    same on every answer) and which of the ids it asks about the worker still holds, until
    the request is aborted."""
    with grpc.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        call = stub.Decode(decode_request("held", [9] * 20), timeout=60)
        next(call)
        load = worker_load(worker.address, ["held", "never-sent"])
        assert list(load.held_request_ids) == ["held"]
        assert load.instance_id and worker_load(worker.address).instance_id == load.instance_id
        assert stub.Abort(worker_pb2.AbortRequest(request_id="held"), timeout=10).found
        wait_until(lambda: not worker_load(worker.address, ["held"]).held_request_ids,
                   timeout=20)
        call.cancel()
    wait_until(lambda: is_idle(worker.address), timeout=20)


def test_a_second_stream_with_a_live_request_id_is_refused_and_leaves_the_first_alone(worker):
    """A duplicate id gets ALREADY_EXISTS; the first stream keeps its events and is not
    aborted by the second handler's clean-up."""
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    with grpc.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        first = stub.Decode(decode_request("dup", [5] * 20, params), timeout=60)
        tokens = list(next(first).token_ids)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Decode(decode_request("dup", [6] * 20, params), timeout=60))
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "'dup'" in info.value.details()
        for message in first:
            tokens += message.token_ids
        assert len(tokens) == 200


def stream_request(request_id: str, prompt: list[int], params: SamplingParams = BUSY,
                   timeout_seconds: float = 0.0) -> worker_pb2.DecodeStreamRequest:
    return worker_pb2.DecodeStreamRequest(start=decode_request(request_id, prompt, params),
                                          timeout_seconds=timeout_seconds)


def test_decode_stream_requests_behave_as_decode_calls_of_their_own(worker):
    """One DecodeStream carries a request that finishes (with the tokens a Decode call gets),
    one whose deadline passes and one the engine refuses, each ending with its own status;
    the stream ends once the caller is done sending and its requests have finished, and the
    deadlined request leaves nothing behind."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = [3, 14, 15, 92, 65] * 4
    with grpc.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        alone = [t for m in stub.Decode(decode_request("alone", prompt, params), timeout=60)
                 for t in m.token_ids]
        requests = [stream_request("s-done", prompt, params),
                    stream_request("s-deadline", [2] * 30, timeout_seconds=0.1),
                    stream_request("s-refused", [1] * 100_000, params)]
        token_ids: dict[str, list[int]] = {r.start.request_id: [] for r in requests}
        statuses: dict[str, grpc.StatusCode] = {}
        messages: list[str] = []
        for message in stub.DecodeStream(iter(requests), timeout=60):
            for update in message.updates:
                token_ids[update.request_id] += update.response.token_ids
                if update.response.finish_reason:
                    statuses[update.request_id] = grpc.StatusCode.OK
                if update.status_code:
                    statuses[update.request_id] = next(
                        c for c in grpc.StatusCode if c.value[0] == update.status_code)
                    messages.append(update.status_message)
    assert statuses == {"s-done": grpc.StatusCode.OK,
                        "s-deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
                        "s-refused": grpc.StatusCode.OUT_OF_RANGE}, (statuses, messages)
    assert token_ids["s-done"] == alone and len(alone) == 12
    wait_until(lambda: is_idle(worker.address), timeout=30)


def test_a_cancelled_decode_stream_aborts_its_requests(worker):
    """The caller going away (a router that died) aborts every request of its stream."""
    before = finished_by_status(worker.metrics_address)
    with grpc.insecure_channel(worker.address) as channel:
        call = worker_pb2_grpc.WorkerStub(channel).DecodeStream(
            iter([stream_request(f"c{i}", [4 + i] * 25) for i in range(3)]), timeout=60)
        seen: set[str] = set()
        for message in call:
            seen.update(update.request_id for update in message.updates)
            if len(seen) == 3:
                break
        call.cancel()
    wait_until(lambda: is_idle(worker.address), timeout=30)
    after = finished_by_status(worker.metrics_address)
    assert after.get("abort", 0) - before.get("abort", 0) == 3, (before, after)
    assert after.get("length", 0) == before.get("length", 0), (before, after)


@pytest.mark.slow
def test_sigterm_with_streams_in_flight_ends_the_worker_with_code_0(checkpoint, tmp_path):
    """SIGTERM drains in-flight streams (within --shutdown-grace-seconds) and the process
    itself exits 0 soon after, not only its server: `tandem up` and Kubernetes wait for the
    process and SIGKILL it after their own grace."""
    grace = 2.0
    worker, _ = start_worker(checkpoint("llama").path, tmp_path,
                             extra=["--shutdown-grace-seconds", str(grace)])
    outcomes: list = []
    try:
        with grpc.insecure_channel(worker.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            threads = [threading.Thread(target=read_all, daemon=True, args=(stub.Decode(
                decode_request(f"s{i}", [3 + i] * 20), timeout=60), outcomes))
                for i in range(8)]
            for thread in threads:
                thread.start()
            wait_until(lambda: worker_load(worker.address).num_running > 0, timeout=20)
            worker.popen.send_signal(signal.SIGTERM)
            assert worker.popen.wait(timeout=grace + 10) == 0, worker.log_tail()
            for thread in threads:
                thread.join(timeout=10)
        assert len(outcomes) == 8  # every stream ended (finished or cut at the grace)
        assert "stopped" in worker.log_tail(5)
    finally:
        stop([worker])


@pytest.mark.slow
def test_sigterm_to_tandem_up_stops_every_worker_without_killing_it(checkpoint, tmp_path):
    """`tandem up --prefill 1 --decode 2` after traffic (streams cut by their deadline
    included): SIGTERM stops the router and every worker within the grace, none SIGKILLed."""
    up, processes = start_up(["--model", str(checkpoint("llama").path), "--dtype", "float32",
                              "--prefill", "1", "--decode", "2"], tmp_path)
    children = child_pids(up.pid)
    try:
        router = processes["router"][0]
        for i in range(3):
            generate(router, request([3 + i] * 20, max_tokens=16))
        for i in range(4):
            with pytest.raises(grpc.RpcError):
                generate(router, request([9 + i] * 20, max_tokens=450), timeout=0.3)
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    log = (tmp_path / "up.log").read_text()
    assert "did not stop" not in log, log[-3000:]
    wait_gone(children, timeout=10)
