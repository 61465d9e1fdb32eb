"""tandem.bench: statistics on hand-built records, workloads, the JSONL reader, and whole runs
against a real grpc.aio stand-in router.

The stand-in (ScriptedGenerate) streams max_tokens tokens, two per chunk, and misbehaves by
request index (the load generator's request ids end in it): index % 5 == 3 aborts with
RESOURCE_EXHAUSTED after one chunk, index 11 ends its stream without a Complete. It answers
INVALID_ARGUMENT if min_tokens != max_tokens and OUT_OF_RANGE for an EOS or out-of-vocab
prompt id, so those mistakes of the benchmark's would show up as errors.
"""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from helpers.standin_server import serve_generate

from tandem import cli
from tandem.bench import BenchmarkConfig, BenchmarkError, run_benchmark
from tandem.bench.records import RequestRecord
from tandem.bench.report import compute_stats, format_table
from tandem.bench.workload import (FilePrompt, LengthDist, file_workload, read_prompts_file,
                                   synthetic_workload)
from tandem.v1 import generate_pb2 as pb
from tandem.v1 import generate_pb2_grpc

VOCAB_SIZE, EOS_ID = 1000, 2
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def record(index, start, chunks=(), end=None, prompt=0, error=None, warmup=False):
    """A finished RequestRecord; `chunks` are (arrival_s, num_tokens)."""
    rec = RequestRecord(index=index, start_s=start, end_s=end, is_warmup=warmup,
                        num_prompt_tokens=prompt, error_code=error)
    for arrival, num_tokens in chunks:
        rec.add_chunk(arrival, num_tokens)
    return rec


def hand_built_records():
    return [
        # 4 tokens, the last two in one chunk: token times 0.1, 0.2, 0.3, 0.4.
        record(0, 0.0, [(0.1, 1), (0.2, 1), (0.4, 2)], end=0.5, prompt=10),
        # 3 tokens, the first two in the first chunk: token times 0.7, 0.7, 1.1.
        record(1, 0.5, [(0.7, 2), (1.1, 1)], end=1.2, prompt=20),
        record(2, 1.0, [(1.2, 3)], end=1.5, prompt=7, error="UNAVAILABLE"),  # partial output
        record(3, 1.5, [(1.6, 1)], end=2.0, prompt=5),  # one token: no TPOT, no ITL
        record(4, 0.2, end=1.0, error="DEADLINE_EXCEEDED"),
        record(5, 1.9, end=1.95, error="UNAVAILABLE"),
        record(6, -1.0, [(-0.5, 4)], end=3.0, prompt=100, warmup=True),  # outside everything
    ]


def test_token_times_spread_a_chunk_over_the_gap_since_the_previous_one():
    rec = record(0, 0.0, [(1.0, 2), (1.3, 3)], end=1.4)
    assert rec.token_times_s() == pytest.approx([1.0, 1.0, 1.1, 1.2, 1.3])
    assert rec.itls_s() == pytest.approx([0.0, 0.1, 0.1, 0.1])
    assert rec.ttft_s == pytest.approx(1.0) and rec.tpot_s == pytest.approx(0.3 / 4)


def test_stats_on_hand_built_records():
    stats = compute_stats(hand_built_records())
    assert (stats["num_requests"], stats["num_ok"], stats["num_errors"],
            stats["num_warmup"]) == (6, 3, 3, 1)
    assert stats["errors"] == {"DEADLINE_EXCEEDED": 1, "UNAVAILABLE": 2}
    assert stats["duration_s"] == pytest.approx(2.0)  # first measured send 0.0, last end 2.0
    assert (stats["total_prompt_tokens"], stats["total_output_tokens"]) == (35, 8)
    assert stats["request_throughput"] == pytest.approx(1.5)
    assert stats["output_token_throughput"] == pytest.approx(4.0)
    assert stats["total_token_throughput"] == pytest.approx(21.5)
    assert stats["goodput"] is None
    expected = {  # numpy's linear interpolation, worked by hand
        "ttft_s": dict(count=3, mean=0.4 / 3, p50=0.1, p90=0.18, p99=0.198, max=0.2),
        "tpot_s": dict(count=2, mean=0.15, p50=0.15, p90=0.19, p99=0.199, max=0.2),
        "itl_s": dict(count=5, mean=0.14, p50=0.1, p90=0.28, p99=0.388, max=0.4),
        "e2e_s": dict(count=3, mean=1.7 / 3, p50=0.5, p90=0.66, p99=0.696, max=0.7),
    }
    for key, summary in expected.items():
        assert stats[key] == pytest.approx(summary), key


@pytest.mark.parametrize("slo_ttft, slo_tpot, num_good", [
    (0.15, 0.15, 2),   # request 1 misses both; request 3 has no TPOT and meets that SLO
    (None, 0.15, 2),
    (0.25, None, 3),
    (0.05, 1.0, 0),
])
def test_goodput_counts_ok_requests_meeting_every_slo(slo_ttft, slo_tpot, num_good):
    stats = compute_stats(hand_built_records(), slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot)
    assert stats["goodput"]["num_good"] == num_good
    assert stats["goodput"]["requests_per_s"] == pytest.approx(num_good / 2.0)


def test_stats_without_requests_are_empty_not_errors():
    stats = compute_stats([])
    assert stats["num_requests"] == 0 and stats["request_throughput"] is None
    assert stats["ttft_s"] == {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None,
                               "max": None}
    assert "n/a" in format_table(stats, router="r:1", load="concurrency 1")


def test_table_rows():
    stats = compute_stats(hand_built_records(), slo_ttft_s=0.15, slo_tpot_s=0.15)
    table = format_table(stats, router="127.0.0.1:1", load="concurrency 2", model="m")
    lines = table.splitlines()
    assert len({len(line) for line in lines if set(line) <= {"=", "-"}}) == 1
    assert "127.0.0.1:1 (m)" in table and "DEADLINE_EXCEEDED 1, UNAVAILABLE 2" in table
    assert "1.00 req/s (2/3 met TTFT <= 150 ms, TPOT <= 150 ms)" in table
    ttft_row = next(line for line in lines if line.startswith("TTFT"))
    assert ttft_row.split()[1:] == ["133.33", "100.00", "180.00", "198.00", "200.00"]


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert LengthDist.parse("32").sample(rng) == 32
    uniform = LengthDist.parse("uniform:3:5")
    assert {uniform.sample(rng) for _ in range(200)} == {3, 4, 5}
    normal = [LengthDist.parse("normal:2:50").sample(rng) for _ in range(200)]
    assert min(normal) == 1 and max(normal) > 20
    assert [str(LengthDist.parse(t)) for t in ("7", "uniform:1:9", "normal:128:32.5")] == \
        ["7", "uniform:1:9", "normal:128:32.5"]
    for bad in ("0", "uniform:5:3", "normal:1", "uniform:1.5:3", "words", "normal:5:-1"):
        with pytest.raises(ValueError, match="--input-len"):
            LengthDist.parse(bad, "--input-len")
    with pytest.raises(ValueError, match="output_len"):
        BenchmarkConfig(output_len="uniform:9:1")


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_synthetic_workload_is_seeded_and_avoids_eos():
    def specs(seed, **kw):
        args = dict(vocab_size=10, eos_token_ids=[0, 9], max_model_len=4096, seed=seed)
        return take(synthetic_workload(LengthDist.parse("uniform:1:50"),
                                       LengthDist.parse("normal:20:5"), **{**args, **kw}), 30)

    first = specs(7)
    assert first == specs(7) and first != specs(8)
    assert len({len(s.token_ids) for s in first}) > 5  # several lengths drawn
    assert all(1 <= t <= 8 for s in first for t in s.token_ids)
    clipped = take(synthetic_workload(LengthDist.parse("100"), LengthDist.parse("50"),
                                      vocab_size=10, eos_token_ids=[], max_model_len=64,
                                      seed=0), 1)[0]
    assert (len(clipped.token_ids), clipped.max_tokens) == (14, 50)


def test_file_workload_cycles_in_order_and_line_max_tokens_win():
    prompts = [FilePrompt(text="a"), FilePrompt(messages=({"role": "user", "content": "b"},),
                                                max_tokens=3)]
    specs = take(file_workload(prompts, LengthDist.parse("uniform:10:20"), seed=1), 4)
    assert [s.text for s in specs] == ["a", None, "a", None]
    assert specs[1].messages[0]["content"] == "b"
    assert specs[1].max_tokens == specs[3].max_tokens == 3
    assert 10 <= specs[0].max_tokens <= 20
    assert specs == take(file_workload(prompts, LengthDist.parse("uniform:10:20"), seed=1), 4)


def test_prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hello", "max_tokens": 5}\n\n'
                    '{"messages": [{"role": "user", "content": "Hi"}]}\n', encoding="utf-8")
    assert read_prompts_file(path) == [
        FilePrompt(text="Hello", max_tokens=5),
        FilePrompt(messages=({"role": "user", "content": "Hi"},))]
    bad_lines = ['{"prompt": "x"', '{"prompt": "x", "messages": []}', '["x"]',
                 '{"prompt": "x", "max_tokens": 0}', '{"messages": [{"role": "user"}]}']
    for bad in bad_lines:
        path.write_text('{"prompt": "ok"}\n{"prompt": "ok"}\n' + bad + "\n", encoding="utf-8")
        with pytest.raises(ValueError, match=r"prompts\.jsonl, line 3: "):
            read_prompts_file(path)


class ScriptedGenerate(generate_pb2_grpc.GenerateServicer):
    async def Generate(self, request, context):
        index = int(request.request_id.rsplit("-", 1)[1])
        num_tokens = request.stop.max_tokens
        if request.stop.min_tokens != num_tokens:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "stop.min_tokens")
        if any(t >= VOCAB_SIZE or t == EOS_ID for t in request.token_ids.ids):
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, "token_ids")
        for first in range(0, num_tokens, 2):
            ids = list(range(first, min(first + 2, num_tokens)))
            yield pb.GenerateResponse(chunk=pb.Chunk(text="x" * len(ids), token_ids=ids))
            if index % 5 == 3:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "admission queue full")
            await asyncio.sleep(0.002)
        if index == 11:
            return
        yield pb.GenerateResponse(complete=pb.Complete(
            request_id=request.request_id, finish_reason=pb.FINISH_REASON_LENGTH,
            usage=pb.Usage(prompt_tokens=len(request.token_ids.ids) or 4,
                           completion_tokens=num_tokens)))

    async def GetModelInfo(self, request, context):
        return pb.GetModelInfoResponse(model="scripted", max_model_len=4096,
                                       vocab_size=VOCAB_SIZE, eos_token_ids=[EOS_ID])


@pytest.fixture(scope="module")
def router():
    """host:port of a ScriptedGenerate grpc.aio server running in a background thread."""
    with serve_generate(ScriptedGenerate()) as address:
        yield address


@pytest.mark.parametrize("load", [dict(concurrency=4), dict(rate=400.0)])
def test_run_counts_requests_and_errors(router, load):
    config = BenchmarkConfig(router=router, num_requests=20, warmup=2, input_len="uniform:4:16",
                             output_len="8", slo_ttft_s=1.0, slo_tpot_s=1.0, **load)
    result = run_benchmark(config)
    stats = result.stats
    # Measured indices 2..21: 3, 8, 13 and 18 are refused, 11 loses its Complete.
    assert (stats["num_requests"], stats["num_ok"], stats["num_warmup"]) == (20, 15, 2)
    assert stats["errors"] == {"INCOMPLETE_STREAM": 1, "RESOURCE_EXHAUSTED": 4}
    assert stats["total_output_tokens"] == 15 * 8
    assert stats["tpot_s"]["count"] == stats["ttft_s"]["count"] == 15
    assert stats["itl_s"]["count"] == 15 * 7
    assert stats["goodput"]["num_good"] == 15
    assert 15 * (4 + 8) <= stats["total_prompt_tokens"] + stats["total_output_tokens"] \
        <= 15 * (16 + 8)
    data = json.loads(result.to_json())
    assert data["model"]["model"] == "scripted" and len(data["requests"]) == 22
    assert data["config"]["concurrency" if "concurrency" in load else "rate"] is not None


@pytest.mark.parametrize("load", [dict(concurrency=4), dict(rate=400.0)])
def test_processes_split_one_workload_and_report_the_generator_cpu(router, load):
    """Two processes: every global index once, warmup 0 and 1 as in one process; each process
    numbers its own request ids (0..10), so the stand-in refuses its local 3 and 8 in each."""
    config = BenchmarkConfig(router=router, num_requests=20, warmup=2, input_len="uniform:4:16",
                             output_len="8", processes=2, **load)
    result = run_benchmark(config)
    assert sorted(r.index for r in result.records) == list(range(22))
    assert {r.index for r in result.records if r.is_warmup} == {0, 1}
    stats = result.stats
    assert (stats["num_requests"], stats["num_ok"]) == (20, 16)
    assert stats["errors"] == {"RESOURCE_EXHAUSTED": 4}
    assert stats["generator"]["processes"] == 2 and stats["generator"]["cpu_cores"] > 0
    assert "Load generator CPU" in result.table()
    single = run_benchmark(BenchmarkConfig(router=router, num_requests=4, output_len="4",
                                           concurrency=2))
    assert single.stats["generator"]["processes"] == 1


def test_more_processes_than_concurrency_is_refused():
    with pytest.raises(ValueError, match="processes"):
        BenchmarkConfig(concurrency=2, processes=3)


def test_duration_stops_starting_requests(router):
    result = run_benchmark(BenchmarkConfig(router=router, concurrency=2, duration_s=0.3,
                                           input_len="4", output_len="4"))
    measured = [r for r in result.records if not r.is_warmup]
    assert len(measured) >= 4
    assert max(r.start_s for r in measured) - min(r.start_s for r in measured) < 0.35


def test_cli_writes_json_plot_and_prints_table_last(router, tmp_path, capsys):
    json_path, png_path = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = cli.main(["bench", "--router", router, "--concurrency", "3", "--num-requests", "10",
                   "--input-len", "normal:8:3", "--output-len", "6", "--seed", "3",
                   "--slo-ttft", "0.5", "--json", str(json_path), "--plot", str(png_path)])
    out, err = capsys.readouterr()
    assert rc == 0
    assert png_path.read_bytes()[:8] == PNG_MAGIC
    data = json.loads(json_path.read_text())
    assert data["config"]["seed"] == 3 and data["stats"]["num_requests"] == 10
    assert data["stats"]["errors"] == {"RESOURCE_EXHAUSTED": 2}  # indices 3 and 8
    assert out.rstrip().splitlines()[-1] == "=" * 64 and "Tandem benchmark" in out
    assert "Latency (ms)" in out and "RESOURCE_EXHAUSTED 2" in out
    assert "bench (concurrency 3)" in err and "wrote" in err


def test_cli_rate_sweep(router, tmp_path, capsys):
    json_path, png_path = tmp_path / "sweep.json", tmp_path / "sweep.png"
    rc = cli.main(["bench", "--router", router, "--rates", "100,300", "--num-requests", "6",
                   "--output-len", "4", "--input-len", "4", "--no-progress",
                   "--json", str(json_path), "--plot", str(png_path)])
    out, err = capsys.readouterr()
    assert rc == 0 and err.count("wrote") == 2 and "bench (" not in err
    assert png_path.read_bytes()[:8] == PNG_MAGIC
    data = json.loads(json_path.read_text())
    assert data["rates"] == [100.0, 300.0]
    assert [run["config"]["rate"] for run in data["runs"]] == [100.0, 300.0]
    assert out.count("Tandem benchmark") == 2
    assert out.rstrip().splitlines()[-5].strip("= ") == "Poisson rate sweep (latencies in ms)"


def test_unreachable_router_and_bad_flags(tmp_path, capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(BenchmarkError, match="GetModelInfo: UNAVAILABLE"):
        run_benchmark(BenchmarkConfig(router=address, num_requests=1))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert cli.main(["bench", "--router", address, "--prompts-file", str(bad)]) == 1
    assert "bad.jsonl, line 1: not valid JSON" in capsys.readouterr().err
    assert cli.main(["bench", "--rates", "1,x"]) == 1
    assert "--rates" in capsys.readouterr().err
    with pytest.raises(ValueError, match="concurrency/rate"):
        BenchmarkConfig(concurrency=2, rate=1.0)


def test_plot_without_matplotlib_fails_before_the_run(router, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises
    rc = cli.main(["bench", "--router", router, "--num-requests", "3", "--output-len", "4",
                   "--plot", str(tmp_path / "b.png"), "--json", str(tmp_path / "b.json")])
    out, err = capsys.readouterr()
    assert rc == 1 and "--plot needs matplotlib" in err
    assert "bench (" not in err and out == "" and not (tmp_path / "b.json").exists()


class CountingGenerate(ScriptedGenerate):
    """ScriptedGenerate that counts the streams it has finished."""

    def __init__(self) -> None:
        self.num_finished = 0

    async def Generate(self, request, context):
        async for response in super().Generate(request, context):
            yield response
        self.num_finished += 1


@pytest.mark.slow
def test_ctrl_c_reports_and_writes_the_requests_that_finished(tmp_path):
    servicer = CountingGenerate()
    json_path = tmp_path / "partial.json"
    with serve_generate(servicer) as address:
        bench = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "bench", "--router", address, "--concurrency",
             "2", "--num-requests", "100000", "--input-len", "4", "--output-len", "40",
             "--json", str(json_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        deadline = time.monotonic() + 60
        while servicer.num_finished < 5:
            assert bench.poll() is None and time.monotonic() < deadline, bench.stderr.read()
            time.sleep(0.05)
        bench.send_signal(signal.SIGINT)
        out, err = bench.communicate(timeout=60)
    assert bench.returncode == 130, err
    assert "interrupted; reporting the requests that finished" in err
    assert "Tandem benchmark" in out and "Latency (ms)" in out
    data = json.loads(json_path.read_text())
    assert 5 <= len(data["requests"]) < 100000
    assert data["stats"]["num_requests"] == len(data["requests"])
    assert all(r.get("error_code") != "CANCELLED" for r in data["requests"])
