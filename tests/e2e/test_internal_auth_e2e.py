"""Without TLS, the workers accept Worker and KVTransfer calls only with the internal token that
the router and peer workers send; the public token guards the router. Real processes."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.checkpoints import random_prompts
from helpers.client import WORKER_RPCS, call_worker_rpc, request
from helpers.processes import start_stack, stop

from tandem.common.security import INTERNAL_TOKEN_KEY
from tandem.router import server as router_server
from tandem.v1 import generate_pb2_grpc, worker_pb2, worker_pb2_grpc

PUBLIC_TOKEN = "public-s3cret"
INTERNAL_TOKEN = "internal-s3cret"


@pytest.fixture(scope="module")
def token_stack(checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("internal_auth")
    (tmp / "public").write_text(PUBLIC_TOKEN + "\n")
    (tmp / "internal").write_text(INTERNAL_TOKEN + "\n")
    internal = ["--internal-token-file", str(tmp / "internal")]
    stack = start_stack(checkpoint("llama").path, tmp, worker_args=internal,
                        router_args=["--auth-token-file", str(tmp / "public"), *internal])
    yield stack
    stop(stack.processes)


def test_the_stack_serves_through_the_router(token_stack, checkpoint):
    [prompt] = random_prompts([20], seed=71)
    with grpc.insecure_channel(token_stack.router.address) as channel:
        responses = generate_pb2_grpc.GenerateStub(channel).Generate(
            request(prompt, max_tokens=10),
            metadata=[("authorization", f"Bearer {PUBLIC_TOKEN}")], timeout=60)
        tokens = [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids]
    assert tokens == checkpoint("llama").greedy(prompt, 10)  # router -> prefill -> decode pull


@pytest.mark.parametrize("service,method,request_type", WORKER_RPCS,
                         ids=[rpc[1] for rpc in WORKER_RPCS])
def test_worker_rpcs_without_the_internal_token_are_unauthenticated(
        token_stack, service, method, request_type):
    for worker in token_stack.workers.values():
        with grpc.insecure_channel(worker.address) as channel:
            for metadata in ([], [(INTERNAL_TOKEN_KEY, "wrong")],
                             [("authorization", f"Bearer {PUBLIC_TOKEN}")]):
                with pytest.raises(grpc.RpcError) as info:
                    call_worker_rpc(channel, service, method, request_type, metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (worker.name,
                                                                              metadata)


def test_health_stays_open_and_the_token_admits(token_stack):
    for worker in token_stack.workers.values():
        with grpc.insecure_channel(worker.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            load = worker_pb2_grpc.WorkerStub(channel).GetLoad(
                worker_pb2.GetLoadRequest(), metadata=[(INTERNAL_TOKEN_KEY, INTERNAL_TOKEN)],
                timeout=5)
            assert load.kv_usage >= 0.0


def test_router_refuses_a_public_token_without_an_internal_one(checkpoint, tmp_path, capsys):
    (tmp_path / "public").write_text(PUBLIC_TOKEN)
    code = router_server.main(["--model", str(checkpoint("llama").path), "--port", "1",
                               "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2",
                               "--auth-token-file", str(tmp_path / "public")])
    assert code == 2
    assert "--internal-token-file" in capsys.readouterr().err
