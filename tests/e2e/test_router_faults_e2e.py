"""Router-side reliability on real processes: undecodable request bytes, two calls sharing a
client request_id, an overload burst, and a frozen (SIGSTOPped) decode worker whose streams
migrate."""
from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from helpers.client import generate, metric_sum, request, router_counter, worker_load
from helpers.processes import admit_late, free_port, start_stack, stop, wait_until

MAX_CONCURRENCY, MAX_QUEUE = 2, 2
LONG = dict(max_tokens=450)  # several seconds of streaming on CPU


@pytest.fixture(scope="module")
def small_router(checkpoint, tmp_path_factory):
    """router (2 running, 2 queued at most) -> 1 prefill -> 1 decode on the tiny Llama."""
    metrics_port = free_port()
    stack = start_stack(checkpoint("llama").path, tmp_path_factory.mktemp("router_faults"),
                        router_args=["--max-concurrency", str(MAX_CONCURRENCY),
                                     "--max-queue", str(MAX_QUEUE),
                                     "--metrics-port", str(metrics_port),
                                     "--metrics-host", "127.0.0.1"])
    stack.router_metrics = f"127.0.0.1:{metrics_port}"
    yield stack
    stop(stack.processes)




def workers_idle(stack) -> bool:
    loads = [worker_load(w.address) for w in stack.workers.values() if w.is_alive()]
    return all(l.kv_usage == 0 and l.num_pinned == 0 and l.num_running == 0
               and l.num_waiting == 0 for l in loads)


@pytest.mark.parametrize("payload", [
    b"\xff\xff\xff\xff",  # not a protobuf message
    b"\x1a\x02\xff\xfe",  # text (field 3) that is not UTF-8
    b"\x0a\x03a\x80b\x1a\x02hi",  # request_id that is not UTF-8
    b"\x1a\x10hi",  # text whose length runs past the end
], ids=["garbage", "text-utf8", "request-id-utf8", "truncated"])
def test_undecodable_request_bytes_get_invalid_argument(small_router, payload):
    with grpc.insecure_channel(small_router.router.address) as channel:
        generate_raw = channel.unary_stream("/tandem.v1.Generate/Generate")
        with pytest.raises(grpc.RpcError) as info:
            list(generate_raw(payload, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "not a valid tandem.v1.GenerateRequest" in info.value.details()


def test_two_calls_with_one_request_id_get_their_own_answers(small_router):
    address = small_router.router.address
    prompts = {"a": [11] * 20, "b": [12, 13] * 10}
    alone = {name: generate(address, request(prompt, max_tokens=200)).token_ids
             for name, prompt in prompts.items()}
    results, errors = {}, {}

    def run(name):
        try:
            results[name] = generate(address, request(prompts[name], max_tokens=200,
                                                      request_id="shared"), timeout=60)
        except grpc.RpcError as exc:
            errors[name] = f"{exc.code().name}: {exc.details()}"

    first = threading.Thread(target=run, args=("a",))
    first.start()
    wait_until(lambda: worker_load(small_router.workers["decode-0"].address).num_running == 1,
               timeout=20)
    run("b")  # while "a" is decoding
    first.join(timeout=60)
    assert not errors, errors
    for name in prompts:
        assert results[name].token_ids == alone[name]
        assert results[name].complete.request_id == "shared"
    wait_until(lambda: workers_idle(small_router), timeout=5)


def test_burst_excess_gets_resource_exhausted_at_once_with_a_retry_hint(small_router):
    """The excess of a burst is refused RESOURCE_EXHAUSTED at once with a retry hint, and the
    router times each refusal (tandem:refusal_seconds)."""
    num_calls = 10 * MAX_CONCURRENCY
    refusals_timed = metric_sum(small_router.router_metrics, "tandem:refusal_seconds_count")
    outcomes: dict[int, tuple] = {}
    barrier = threading.Barrier(num_calls)

    def run(i):
        barrier.wait()
        try:
            generate(small_router.router.address, request([20 + i] * 20, **LONG), timeout=120)
            outcomes[i] = ("complete", time.monotonic(), None)
        except grpc.RpcError as exc:
            outcomes[i] = (exc.code(), time.monotonic(), dict(exc.trailing_metadata() or ()))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(num_calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    refused = [o for o in outcomes.values() if o[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    completed = [o for o in outcomes.values() if o[0] == "complete"]
    assert len(refused) == num_calls - MAX_CONCURRENCY - MAX_QUEUE, outcomes
    assert len(completed) == MAX_CONCURRENCY + MAX_QUEUE, outcomes
    # At once: every refusal came back while the first admitted calls were still streaming.
    assert max(o[1] for o in refused) < min(o[1] for o in completed)
    for _, _, metadata in refused:
        assert int(metadata["retry-after-ms"]) >= 100
    assert metric_sum(small_router.router_metrics, "tandem:refusal_seconds_count") \
        == refusals_timed + len(refused)
    wait_until(lambda: workers_idle(small_router), timeout=5)


def test_request_whose_deadline_passes_in_the_queue_never_reaches_a_worker(small_router):
    """gRPC cancels a call waiting for admission at its deadline, and the servicer checks the
    deadline again once admitted: either way no worker sees the request."""
    address, metrics = small_router.router.address, small_router.router_metrics
    routed_before = router_counter(metrics, "tandem:routing_decisions", role="prefill")
    threads = [threading.Thread(target=generate, args=(address, request([40 + i] * 20, **LONG)))
               for i in range(MAX_CONCURRENCY)]
    for thread in threads:
        thread.start()
    wait_until(lambda: router_counter(metrics, "tandem:routing_decisions", role="prefill")
               == routed_before + MAX_CONCURRENCY, timeout=20)
    with pytest.raises(grpc.RpcError) as info:
        generate(address, request([50] * 20, max_tokens=4), timeout=0.3)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for thread in threads:
        thread.join(timeout=60)
    assert router_counter(metrics, "tandem:routing_decisions", role="prefill") \
        == routed_before + MAX_CONCURRENCY
    wait_until(lambda: workers_idle(small_router), timeout=5)


def test_a_full_router_refuses_before_tokenizing(small_router):
    """With every running and queue place taken, a text prompt is refused RESOURCE_EXHAUSTED
    without reaching the tokenizer: refusing is the first thing a call does."""
    address, metrics = small_router.router.address, small_router.router_metrics
    num_places = MAX_CONCURRENCY + MAX_QUEUE
    threads = [threading.Thread(target=generate, args=(address, request([60 + i] * 20, **LONG)),
                                kwargs=dict(timeout=120)) for i in range(num_places)]
    for thread in threads:
        thread.start()
    wait_until(lambda: metric_sum(metrics, "tandem:num_requests_running") == MAX_CONCURRENCY
               and metric_sum(metrics, "tandem:num_requests_waiting") == MAX_QUEUE, timeout=20)
    tokenized = metric_sum(metrics, "tandem:tokenization_time_seconds_count")
    with pytest.raises(grpc.RpcError) as info:
        generate(address, request("a text prompt the tokenizer never sees"), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    assert metric_sum(metrics, "tandem:tokenization_time_seconds_count") == tokenized
    for thread in threads:
        thread.join(timeout=120)
    wait_until(lambda: workers_idle(small_router), timeout=5)


NUM_FROZEN_STREAMS = 8


@pytest.mark.slow
def test_frozen_decode_worker_streams_move_to_the_other_and_it_is_ejected(checkpoint, tmp_path):
    """All 8 streams of a decode worker stall when it is SIGSTOPped, migrate to the other
    decode worker (admitted to the router only once the 8 run on the first) and finish there
    with the tokens of an undisturbed run; after SIGCONT the worker rejoins through its probe
    and holds no KV block."""
    stall_seconds = 3
    metrics_address = f"127.0.0.1:{free_port()}"
    stack = start_stack(checkpoint("llama").path, tmp_path, num_late_decode=1, router_args=[
        "--stall-timeout-seconds", str(stall_seconds), "--first-token-timeout-seconds", "20",
        "--metrics-port", metrics_address.rsplit(":", 1)[1], "--metrics-host", "127.0.0.1"])
    victim, other = stack.workers["decode-0"], stack.workers["decode-1"]
    ejections = dict(name="tandem:worker_ejections", worker=victim.address, cause="stall")
    rejoins = dict(name="tandem:worker_rejoins", worker=victim.address)
    prompts = [[30 + i] * 20 for i in range(NUM_FROZEN_STREAMS)]
    outcomes: dict[int, object] = {}

    def stream(i):
        try:
            outcomes[i] = generate(stack.router.address, request(prompts[i], **LONG),
                                   timeout=90)
        except grpc.RpcError as exc:
            outcomes[i] = exc

    def run_all() -> list[threading.Thread]:
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        return threads

    try:
        for thread in run_all():
            thread.join(timeout=90)
        undisturbed = {i: outcome.token_ids for i, outcome in outcomes.items()}
        assert len(undisturbed) == len(prompts)
        outcomes.clear()
        threads = run_all()
        wait_until(lambda: worker_load(victim.address).num_running == NUM_FROZEN_STREAMS,
                   timeout=30, interval=0.01)
        admit_late(stack)  # the other decode worker, to migrate to
        victim.popen.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        for thread in threads:
            thread.join(timeout=60)
            assert not thread.is_alive(), "a stream on the frozen worker hung"
        errors = [o for o in outcomes.values() if isinstance(o, grpc.RpcError)]
        assert not errors, [f"{e.code().name}: {e.details()}" for e in errors]
        for i, outcome in outcomes.items():
            assert outcome.token_ids == undisturbed[i], f"stream {i}"
        # Every stream was on the frozen worker and moved once, to the other one.
        assert [o.complete.usage.num_migrations for o in outcomes.values()] \
            == [1] * NUM_FROZEN_STREAMS
        assert router_counter(metrics_address, "tandem:request_migrations",
                              cause="stall") == NUM_FROZEN_STREAMS
        # Well before the call's own 90 s deadline (the stall timeout is 3 s).
        assert time.monotonic() - stopped_at < 60
        assert router_counter(metrics_address, **ejections) == 1
        # The frozen worker is out of the pool: new requests go to the other one.
        for i in range(3):
            assert generate(stack.router.address, request([3, i], max_tokens=8),
                            timeout=30).complete
        assert router_counter(metrics_address, **rejoins) == 0
        assert worker_load(other.address).num_running == 0
        victim.popen.send_signal(signal.SIGCONT)
        # Back after its ejection backoff, on a good health check (the probe) that finds the
        # attempts that moved away dropped (cancelled streams, Aborts): it holds no request
        # and no KV block from the moment it rejoins.
        wait_until(lambda: router_counter(metrics_address, **rejoins) >= 1, timeout=30,
                   interval=0.01)
        load = worker_load(victim.address)
        assert (load.num_running, load.num_waiting, load.kv_usage) == (0, 0, 0), load
        assert workers_idle(stack)
        assert router_counter(metrics_address, **rejoins) == 1
        assert router_counter(metrics_address, **ejections) == 1
    finally:
        victim.popen.send_signal(signal.SIGCONT)
        stop(stack.processes)
