"""TandemClient, AsyncTandemClient and `tandem generate` against a real gRPC stand-in router.

The stand-in Generate service (EchoGenerate) streams the request it received back as text, in
three chunks of two tokens each, so tests read back exactly which fields the client set.
"""
from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from google.protobuf import text_format

from helpers.certs import make_identities
from helpers.standin_server import serve_generate

from tandem import cli
from tandem.common.security import BearerTokenInterceptor, TLSFiles
from tandem.client import AsyncTandemClient, TandemClient, build_request
from tandem.v1 import generate_pb2 as pb
from tandem.v1 import generate_pb2_grpc

TIMINGS = pb.Timings(queue_seconds=0.001, time_to_first_token_seconds=0.02,
                     time_per_output_token_seconds=0.005, e2e_seconds=0.05,
                     prefill_queue_seconds=0.002, prefill_compute_seconds=0.01)


class EchoGenerate(generate_pb2_grpc.GenerateServicer):
    async def Generate(self, request, context):
        if request.text == "invalid":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "sampling.top_p: must be in (0, 1]")
        if request.text == "slow":
            await asyncio.sleep(5)
        if request.text == "deadline":  # how long the client gave the call, in whole seconds
            remaining = context.time_remaining()
            request.text = "none" if remaining is None else f"{remaining:.0f}"
        echo = text_format.MessageToString(request, as_one_line=True)
        cut = len(echo) // 3
        for index, piece in enumerate((echo[:cut], echo[cut:2 * cut], echo[2 * cut:])):
            ids = [2 * index, 2 * index + 1]
            logprobs = [pb.TokenLogprob(token_id=i, logprob=-0.5, rank=1,
                                        top=[pb.TopLogprob(token_id=i, logprob=-0.5)])
                        for i in ids] if request.HasField("logprobs") else []
            yield pb.GenerateResponse(chunk=pb.Chunk(text=piece, token_ids=ids, logprobs=logprobs))
            await asyncio.sleep(0.01)
        yield pb.GenerateResponse(complete=pb.Complete(
            request_id=request.request_id or "assigned-id",
            finish_reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(
                prompt_tokens=4, completion_tokens=6, cached_prompt_tokens=1), timings=TIMINGS))

    async def GetModelInfo(self, request, context):
        return pb.GetModelInfoResponse(model="echo", architectures=["EchoForCausalLM"],
                                       max_model_len=128, vocab_size=1000, eos_token_ids=[2],
                                       has_chat_template=True)


@pytest.fixture(scope="module")
def router():
    """host:port of an EchoGenerate grpc.aio server running in a background thread."""
    with serve_generate(EchoGenerate()) as address:
        yield address


@pytest.fixture(scope="module")
def secured_router(tmp_path_factory):
    """(host:port, identity, token file) of an EchoGenerate server that requires mutual TLS
    and a bearer token, as a router with --tls-* and --auth-token-file does."""
    tmp = tmp_path_factory.mktemp("secured")
    identity = make_identities(tmp / "pki")
    (tmp / "token").write_text("t0ken\n")
    tls = TLSFiles.from_paths(str(identity.cert), str(identity.key), str(identity.ca))
    guard = BearerTokenInterceptor("t0ken", ("/tandem.v1.Generate/",))
    with serve_generate(EchoGenerate(), tls=tls, interceptors=[guard]) as address:
        yield address, identity, tmp / "token"


def echoed(result) -> pb.GenerateRequest:
    return text_format.Parse(result.text, pb.GenerateRequest())


def test_text_prompt_carries_only_the_fields_given(router):
    with TandemClient(router) as client:
        result = client.generate("hi", max_tokens=5, temperature=0.0, stop="\n")
        bare = client.generate("hi")
    assert echoed(result) == pb.GenerateRequest(
        text="hi", sampling=pb.SamplingParameters(temperature=0.0),
        stop=pb.StopConditions(max_tokens=5, stop=["\n"]))
    request = echoed(result)
    assert request.sampling.HasField("temperature") and not request.sampling.HasField("top_p")
    assert not request.HasField("logprobs")
    assert echoed(bare) == pb.GenerateRequest(text="hi")
    assert not echoed(bare).HasField("sampling") and not echoed(bare).HasField("stop")


def test_every_option_and_prompt_form_reaches_the_request(router):
    options = dict(request_id="r1", model="m", max_tokens=9, min_tokens=1, temperature=0.7,
                   top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
                   presence_penalty=0.5, frequency_penalty=-0.5, seed=2**63, stop=["a", "b"],
                   stop_token_ids=[7, 8], ignore_eos=True, logprobs=3)
    with TandemClient(router) as client:
        by_ids = client.generate([1, 2, 3], **options)
        by_chat = client.generate(messages=[{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Hi"}])
    assert echoed(by_ids) == build_request([1, 2, 3], **options)
    request = echoed(by_ids)
    assert list(request.token_ids.ids) == [1, 2, 3] and request.sampling.seed == 2**63
    assert request.sampling.top_k == 40 and request.stop.ignore_eos and request.logprobs == 3
    assert by_ids.request_id == "r1"
    assert len(by_ids.logprobs) == 6 and by_ids.logprobs[0].top == ((0, -0.5),)
    assert [(m.role, m.content) for m in echoed(by_chat).chat.messages] == [
        ("system", "Be brief."), ("user", "Hi")]
    assert by_chat.logprobs is None


def test_result_has_usage_timings_and_client_latencies(router):
    with TandemClient(router) as client:
        result = client.generate("hi")
    assert result.token_ids == [0, 1, 2, 3, 4, 5]
    assert result.finish_reason == "length" and result.request_id == "assigned-id"
    assert result.usage == {"prompt_tokens": 4, "completion_tokens": 6, "cached_prompt_tokens": 1,
                            "num_migrations": 0}
    assert result.timings["time_to_first_token_seconds"] == pytest.approx(0.02)
    assert set(result.timings) == {f.name for f in pb.Timings.DESCRIPTOR.fields}
    assert 0 < result.client_ttft_seconds < result.client_e2e_seconds
    assert result.client_tpot_seconds > 0  # three chunks ~10 ms apart carry six tokens


def test_stream_yields_deltas_then_exposes_the_result(router):
    with TandemClient(router) as client:
        stream = client.stream("hi", max_tokens=6)
        deltas = list(stream)
    assert [d.token_ids for d in deltas] == [[0, 1], [2, 3], [4, 5]]
    assert "".join(d.text for d in deltas) == stream.result.text
    assert echoed(stream.result).stop.max_tokens == 6


def test_errors_are_grpc_status_codes(router):
    with TandemClient(router, timeout=0.3) as client:
        with pytest.raises(grpc.RpcError) as invalid:
            client.generate("invalid")
        with pytest.raises(grpc.RpcError) as late:
            client.generate("slow")
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert invalid.value.details() == "sampling.top_p: must be in (0, 1]"
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(ValueError, match="exactly one"):
        build_request("hi", messages=[{"role": "user", "content": "hi"}])


def test_model_info(router):
    with TandemClient(router) as client:
        info = client.model_info()
    assert info == {"model": "echo", "architectures": ["EchoForCausalLM"], "max_model_len": 128,
                    "vocab_size": 1000, "eos_token_ids": [2], "has_chat_template": True}


def test_async_client_matches_the_sync_one(router):
    async def run():
        async with AsyncTandemClient(router) as client:
            result = await client.generate("hi", top_k=5)
            stream = client.stream([4, 5], seed=1)
            deltas = [delta async for delta in stream]
            info = await client.model_info()
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await client.generate("invalid")
        return result, stream, deltas, info, error.value

    result, stream, deltas, info, error = asyncio.run(run())
    assert echoed(result) == pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(top_k=5))
    assert result.client_tpot_seconds > 0 and result.finish_reason == "length"
    assert [d.token_ids for d in deltas] == [[0, 1], [2, 3], [4, 5]]
    assert list(echoed(stream.result).token_ids.ids) == [4, 5]
    assert info["model"] == "echo"
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_cli_generate_streams_text_and_summarises(router, capsys):
    argv = ["generate", "--router", router, "hello", "--max-tokens", "3", "--stop", "x",
            "--stop", "y", "--top-k", "4"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert text_format.Parse(out, pb.GenerateRequest()) == pb.GenerateRequest(
        text="hello", sampling=pb.SamplingParameters(temperature=0.0, top_k=4),
        stop=pb.StopConditions(max_tokens=3, stop=["x", "y"]))
    assert err.startswith(
        "finish=length prompt_tokens=4 completion_tokens=6 cached=1 | client ttft=")
    assert "router queue=1.0ms ttft=20.0ms tpot=5.0ms" in err

    assert cli.main(["generate", "--router", router, "--chat", "hey"]) == 0
    chat = text_format.Parse(capsys.readouterr().out, pb.GenerateRequest()).chat
    assert [(m.role, m.content) for m in chat.messages] == [("user", "hey")]

    assert cli.main(["generate", "--router", router, "invalid"]) == 1
    assert capsys.readouterr().err == (
        "tandem: error: INVALID_ARGUMENT: sampling.top_p: must be in (0, 1]\n")


def test_clients_reach_a_router_with_tls_and_a_token(secured_router):
    address, identity, _ = secured_router
    files = dict(tls_ca=str(identity.ca), tls_cert=str(identity.cert),
                 tls_key=str(identity.key))
    with TandemClient(address, token="t0ken", **files) as client:
        assert echoed(client.generate("hi")).text == "hi"
        assert client.model_info()["model"] == "echo"
    with TandemClient(address, **files) as client, pytest.raises(grpc.RpcError) as no_token:
        client.generate("hi")
    assert no_token.value.code() == grpc.StatusCode.UNAUTHENTICATED

    async def run_async():
        async with AsyncTandemClient(address, token="t0ken", **files) as client:
            return await client.generate("hey"), await client.model_info()

    result, info = asyncio.run(run_async())
    assert echoed(result).text == "hey" and info["model"] == "echo"


def test_cli_generate_with_token_file_and_tls_flags(secured_router, capsys):
    address, identity, token_file = secured_router
    flags = ["--tls-ca", str(identity.ca), "--tls-cert", str(identity.cert), "--tls-key",
             str(identity.key)]
    assert cli.main(["generate", "--router", address, "hi", "--token-file", str(token_file),
                     *flags]) == 0
    assert text_format.Parse(capsys.readouterr().out, pb.GenerateRequest()).text == "hi"
    assert cli.main(["generate", "--router", address, "hi", *flags]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert cli.main(["generate", "--router", address, "hi", "--tls-cert",
                     str(identity.cert)]) == 1
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err


def test_cli_generate_sends_min_tokens_logprobs_request_id_and_a_default_deadline(
        router, capsys):
    assert cli.main(["generate", "--router", router, "hi", "--min-tokens", "2", "--logprobs",
                     "1", "--request-id", "mine-1"]) == 0
    out, err = capsys.readouterr()
    request = text_format.Parse(out, pb.GenerateRequest())
    assert request.stop.min_tokens == 2 and request.logprobs == 1
    assert request.request_id == "mine-1"
    assert "token 0 logprob=-0.5000 rank=1 top 0:-0.500" in err
    assert cli.main(["generate", "--router", router, "deadline"]) == 0
    remaining = float(text_format.Parse(capsys.readouterr().out, pb.GenerateRequest()).text)
    assert 250 < remaining < 310  # the default deadline, 300 s; --timeout changes it
    assert cli.main(["generate", "--router", router, "deadline", "--timeout", "60"]) == 0
    assert 0 < float(text_format.Parse(capsys.readouterr().out, pb.GenerateRequest()).text) < 70


def test_cli_generate_without_a_router_says_so(capsys):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    assert cli.main(["generate", "--router", address, "hi", "--timeout", "10"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"tandem: error: the router at {address} is not answering; "
                          "is `tandem up` running?")
