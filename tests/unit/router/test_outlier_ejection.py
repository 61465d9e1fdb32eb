"""Health checks and outlier ejection against real gRPC servers (tests/helpers/standin_server):
a slow but alive worker stays in the pool, a dead one leaves on its first failed check, a
flapping one is kept out for a backoff that doubles, a restarted one rejoins on its first good
check. Checks are driven one round at a time with `check_all()`."""
from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack

import pytest
from grpc_health.v1 import health_pb2
from helpers.standin_server import StandinWorker, serve

from tandem.common.metrics import RouterMetrics
from tandem.router.ejection import HealthPolicy
from tandem.router.request_flow import StallLimits
from tandem.router.worker_pool import WorkerPool

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


def count(metrics: RouterMetrics, name: str, worker, **labels) -> float:
    return metrics.registry.get_sample_value(f"tandem:{name}_total", {
        "model": "m", "tier": "router", "worker": worker.address, "role": "both",
        **labels}) or 0.0


async def joined_pool(address: str, policy: HealthPolicy = HealthPolicy(),
                      metrics: RouterMetrics | None = None):
    pool = WorkerPool([], [], [address], policy, metrics=metrics)
    await pool.refresh()
    [worker] = pool.workers
    assert worker.is_healthy, worker.last_error
    return pool, worker


@pytest.mark.slow
def test_slow_but_alive_worker_stays_in_the_pool():
    """A worker too busy to answer a check within a second is still serving."""
    standin = StandinWorker()
    standin.check_delay_seconds = 1.5

    async def scenario(address):
        pool, worker = await joined_pool(address)  # the default policy
        for _ in range(2):
            await pool.check_all()
            assert worker.is_healthy, worker.last_error
        await pool.close()

    with serve(standin.register) as address:
        asyncio.run(scenario(address))
    assert standin.num_checks == 3


def test_slow_checks_eject_after_the_threshold_in_a_row():
    standin = StandinWorker()
    metrics = RouterMetrics("m")

    async def scenario(address):
        policy = HealthPolicy(check_timeout_seconds=0.2, failure_threshold=3)
        pool, worker = await joined_pool(address, policy, metrics)
        standin.check_delay_seconds = 0.5  # every check times out
        for _ in range(2):
            await pool.check_all()
            assert worker.is_healthy
        standin.check_delay_seconds = 0.0  # a good check starts the count again
        await pool.check_all()
        standin.check_delay_seconds = 0.5
        for _ in range(2):
            await pool.check_all()
            assert worker.is_healthy
        await pool.check_all()
        assert not worker.is_healthy and "DEADLINE_EXCEEDED" in worker.last_error
        assert count(metrics, "worker_ejections", worker, cause="failed_checks") == 1
        await pool.close()

    with serve(standin.register) as address:
        asyncio.run(scenario(address))


def test_dead_worker_leaves_on_its_first_failed_check_and_a_failed_request_at_once():
    standin = StandinWorker()
    metrics = RouterMetrics("m")

    async def scenario(address, stop_server):
        pool, worker = await joined_pool(address, HealthPolicy(), metrics)
        pool.mark_failed(worker, "UNAVAILABLE: stream reset")
        assert not worker.is_healthy
        assert count(metrics, "worker_ejections", worker, cause="request") == 1
        await pool.close()

        pool, worker = await joined_pool(address, HealthPolicy(), metrics)
        stop_server()
        await pool.check_all()  # connection refused
        assert not worker.is_healthy and "UNAVAILABLE" in worker.last_error
        assert count(metrics, "worker_ejections", worker, cause="unreachable") == 1
        await pool.close()

    with ExitStack() as stack:
        address = stack.enter_context(serve(standin.register))
        asyncio.run(scenario(address, stack.close))


@pytest.mark.slow
def test_flapping_worker_backs_off_and_rejoins_only_after_a_probe():
    standin = StandinWorker()
    metrics = RouterMetrics("m")
    base = 1.0

    async def scenario(address):
        policy = HealthPolicy(base_ejection_seconds=base, max_ejection_seconds=30)
        pool, worker = await joined_pool(address, policy, metrics)
        backoffs = []
        for _ in range(3):
            standin.status = NOT_SERVING
            await pool.check_all()  # a NOT_SERVING answer ejects at once
            assert not worker.is_healthy
            backoffs.append(worker.outlier.backoff_seconds)
            standin.status = SERVING
            await pool.check_all()  # a good check during the backoff: still out
            assert not worker.is_healthy
            await asyncio.sleep(worker.outlier.ejected_until - time.monotonic())
            await pool.check_all()  # the probe after the backoff brings it back
            assert worker.is_healthy
        assert backoffs == [base, 2 * base, 4 * base]
        assert count(metrics, "worker_ejections", worker, cause="not_serving") == 3
        assert count(metrics, "worker_rejoins", worker) == 3
        await pool.close()

    with serve(standin.register) as address:
        asyncio.run(scenario(address))


@pytest.mark.slow
def test_restarted_worker_rejoins_on_its_first_good_check():
    """Down long enough for gRPC's reconnect backoff to grow past several seconds, then back
    on the same port: the first check after the restart already finds it."""
    standin = StandinWorker()

    async def scenario(server):
        address = server.__enter__()
        pool, worker = await joined_pool(address, HealthPolicy(base_ejection_seconds=1.0))
        server.__exit__(None, None, None)
        down_until = time.monotonic() + 8.0
        while time.monotonic() < down_until:
            await pool.check_all()
            assert not worker.is_healthy
            await asyncio.sleep(0.2)
        port = int(address.rsplit(":", 1)[1])
        with serve(standin.register, port=port):
            await pool.check_all()
            assert worker.is_healthy, worker.last_error
        await pool.close()

    asyncio.run(scenario(serve(standin.register)))


def test_restarted_worker_starts_a_new_history_and_rejoins_on_one_good_probe():
    """A worker killed while its backoff is long and restarted at once on the same port is a
    new process (another instance_id): its first good check brings it back, a request that
    failed on the old process may move to it, and its next ejection starts again from the
    base backoff. The same process keeps its backoff."""
    backoff = 60.0
    policy = HealthPolicy(base_ejection_seconds=backoff, max_ejection_seconds=600)

    async def scenario():
        first = StandinWorker(instance_id="first")
        with serve(first.register) as address:
            pool, worker = await joined_pool(address, policy)
            failed_for_a_request = {worker.process_key}
            pool.mark_failed(worker, "UNAVAILABLE: the worker was killed")
            await pool.check_all()  # the same instance, inside its backoff: still out
            assert not worker.is_healthy
        port = int(address.rsplit(":", 1)[1])
        second = StandinWorker(instance_id="second")
        with serve(second.register, port=port):
            await pool.check_all()
            assert worker.is_healthy, worker.last_error
            assert pool.pick("both", exclude=failed_for_a_request) is worker
            pool.mark_failed(worker, "UNAVAILABLE: killed again soon after it rejoined")
            assert worker.outlier.backoff_seconds == backoff  # not doubled
        await pool.close()

    asyncio.run(scenario())


def test_probe_waits_until_the_worker_dropped_the_requests_given_up_on_there():
    """Requests that moved off an ejected worker (a frozen one, say) must be gone from it
    before it rejoins: the probe asks about them, re-sends their Aborts, and only a check that
    finds none held brings the worker back."""
    standin = StandinWorker()

    async def scenario(address):
        pool, worker = await joined_pool(address, HealthPolicy(base_ejection_seconds=0.1))
        standin.held_request_ids = {"r1.m0", "r2"}
        pool.mark_failed(worker, "did not send the next token within 3.0 s", cause="stall")
        pool.note_abandoned(worker, "r1.m0")
        pool.note_abandoned(worker, "r2")
        pool.note_abandoned(worker, "r3")  # already gone from the worker
        await asyncio.sleep(0.2)  # past the backoff
        standin.check_delay_seconds = 0.0
        await pool.check_all()
        assert not worker.is_healthy
        assert "still holds 2 request(s)" in worker.last_error
        assert sorted(standin.aborted) == ["r1.m0", "r2"]
        await pool.check_all()  # the Aborts dropped them: the probe succeeds
        assert worker.is_healthy, worker.last_error
        await pool.close()

    with serve(standin.register) as address:
        asyncio.run(scenario(address))


def test_policies_name_a_bad_value():
    with pytest.raises(ValueError, match="HealthPolicy.check_timeout_seconds=0"):
        HealthPolicy(check_timeout_seconds=0)
    with pytest.raises(ValueError, match="max_ejection_seconds=1"):
        HealthPolicy(base_ejection_seconds=2, max_ejection_seconds=1)
    with pytest.raises(ValueError, match="StallLimits.max_token_gap_seconds=-1"):
        StallLimits(max_token_gap_seconds=-1)


def test_first_token_allowance_grows_with_the_prompt_and_zero_turns_limits_off():
    limits = StallLimits(max_token_gap_seconds=30, first_token_seconds=120,
                         first_token_seconds_per_1k_tokens=60)
    assert limits.first_token_timeout(0) == 120
    assert limits.first_token_timeout(8000) == 120 + 8 * 60
    assert limits.token_gap_timeout == 30
    off = StallLimits(max_token_gap_seconds=0, first_token_seconds=0)
    assert off.first_token_timeout(8000) is None and off.token_gap_timeout is None
