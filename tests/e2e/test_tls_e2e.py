"""Mutual TLS on every tier and the bearer token on the public API, with real processes and
certificates made for the test."""
from __future__ import annotations

import ssl
import time

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.certs import make_identities
from helpers.checkpoints import random_prompts
from helpers.client import WORKER_RPCS, call_worker_rpc, request
from helpers.processes import free_port, start, stop

from tandem.v1 import generate_pb2_grpc

TOKEN = "s3cret-token"


def secure(address, identity):
    cert, key, ca = identity.read()
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, key, cert))


def health(channel, timeout=2):
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                     timeout=timeout).status


@pytest.fixture(scope="module")
def tls_stack(checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    good = make_identities(tmp / "good")
    tls_flags = ["--tls-cert", str(good.cert), "--tls-key", str(good.key), "--tls-ca",
                 str(good.ca)]
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    model = str(checkpoint("llama").path)
    ports = {name: free_port() for name in ("prefill", "decode", "router", "http")}
    processes = {
        role: start(role, ["tandem.workers.server", "--role", role, "--model", model, "--port",
                           str(ports[role]), "--dtype", "float32", *tls_flags], ports[role], tmp)
        for role in ("prefill", "decode")}
    processes["router"] = start("router", [
        "tandem.router.server", "--model", model, "--port", str(ports["router"]),
        "--prefill", processes["prefill"].address, "--decode", processes["decode"].address,
        "--health-check-interval", "0.3", "--auth-token-file", str(token_file),
        "--http-port", str(ports["http"]), *tls_flags],
        ports["router"], tmp)
    deadline = time.monotonic() + 180
    for process in processes.values():
        with secure(process.address, good) as channel:
            while True:
                assert process.is_alive(), process.log_tail()
                try:
                    if health(channel) == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, process.log_tail()
                time.sleep(0.2)
    processes["router"].http_url = f"https://127.0.0.1:{ports['http']}/v1"
    yield processes, good, tmp
    stop(list(processes.values()))


def test_http_api_is_https_with_client_certificates_and_the_token(tls_stack):
    processes, good, tmp = tls_stack
    url = processes["router"].http_url

    def client(identity, token=TOKEN) -> openai.OpenAI:
        context = ssl.create_default_context(cafile=str(good.ca))
        if identity is not None:
            context.load_cert_chain(str(identity.cert), str(identity.key))
        return openai.OpenAI(base_url=url, api_key=token, max_retries=0, timeout=30,
                             http_client=openai.DefaultHttpxClient(verify=context))

    model = client(good).models.list().data[0].id
    reply = client(good).completions.create(model=model, prompt=[1, 2, 3], max_tokens=3)
    assert reply.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        client(good, token="wrong").models.list()
    with pytest.raises(openai.APIConnectionError):  # no client certificate: no handshake
        client(None).models.list()
    other = make_identities(tmp / "other-http")
    with pytest.raises(openai.APIConnectionError):  # a certificate from another CA
        client(other).models.list()
    plain = openai.OpenAI(base_url=url.replace("https", "http"), api_key=TOKEN, max_retries=0,
                          timeout=10)
    with pytest.raises(openai.APIConnectionError):
        plain.models.list()


def test_normal_path_works_with_certificate_and_token(tls_stack, checkpoint):
    processes, good, _ = tls_stack
    [prompt] = random_prompts([20], seed=61)
    with secure(processes["router"].address, good) as channel:
        responses = generate_pb2_grpc.GenerateStub(channel).Generate(
            request(prompt, max_tokens=12), metadata=[("authorization", f"Bearer {TOKEN}")],
            timeout=30)
        tokens = [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids]
    assert tokens == checkpoint("llama").greedy(prompt, 12)  # prefill -> decode over mTLS


def test_plaintext_and_unknown_certificates_are_refused_on_every_tier(tls_stack):
    processes, good, tmp = tls_stack
    intruder = make_identities(tmp / "intruder", name="intruder", trusted_ca=good.ca)
    for process in processes.values():
        with grpc.insecure_channel(process.address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                health(channel)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with secure(process.address, intruder) as channel:
            with pytest.raises(grpc.RpcError) as info:
                health(channel)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with secure(process.address, good) as channel:
            assert health(channel) == health_pb2.HealthCheckResponse.SERVING


def test_a_call_without_the_token_is_unauthenticated(tls_stack):
    processes, good, _ = tls_stack
    with secure(processes["router"].address, good) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        for metadata in ([], [("authorization", "Bearer wrong")]):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request([1, 2, 3], max_tokens=2), metadata=metadata,
                                   timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert health(channel) == health_pb2.HealthCheckResponse.SERVING  # probes stay open


def test_every_worker_rpc_refuses_a_certificate_from_another_ca(tls_stack):
    processes, good, tmp = tls_stack
    stranger = make_identities(tmp / "stranger", name="stranger", trusted_ca=good.ca)
    for role in ("prefill", "decode"):
        with secure(processes[role].address, stranger) as channel:
            for service, method, request_type in WORKER_RPCS:
                with pytest.raises(grpc.RpcError) as info:
                    call_worker_rpc(channel, service, method, request_type)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE, (role, method)
