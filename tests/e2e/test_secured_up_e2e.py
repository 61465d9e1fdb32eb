"""`tandem up` with a public token and mutual TLS: it gives every child a private internal
token, and `tandem generate` / `tandem bench` reach the router with --token-file and --tls-*."""
from __future__ import annotations

import json
import signal
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from helpers.certs import make_identities
from helpers.processes import child_pids, start_up, wait_gone

from tandem.v1 import worker_pb2, worker_pb2_grpc


def argv_of(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_text().split("\0")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem.cli", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
def test_generate_and_bench_reach_a_secured_tandem_up(checkpoint, tmp_path):
    pki = make_identities(tmp_path / "pki")
    token_file = tmp_path / "token"
    token_file.write_text("public-token\n")
    tls = ["--tls-ca", str(pki.ca), "--tls-cert", str(pki.cert), "--tls-key", str(pki.key)]
    up, processes = start_up(["--model", str(checkpoint("llama").path), "--dtype", "float32",
                              "--auth-token-file", str(token_file), *tls], tmp_path,
                             give_internal_token=False)
    children = child_pids(up.pid)
    try:
        assert set(processes) == {"router", "prefill-0", "decode-0"}, \
            (tmp_path / "up.log").read_text()[-3000:]
        token_paths = set()
        for pid in children:
            argv = argv_of(pid)
            token_paths.add(argv[argv.index("--internal-token-file") + 1])
        [internal_token] = token_paths  # one shared secret, readable by its owner only
        assert stat.S_IMODE(Path(internal_token).stat().st_mode) == 0o600

        cert, key, ca = pki.read()
        credentials = grpc.ssl_channel_credentials(ca, key, cert)
        with grpc.secure_channel(processes["decode-0"][0], credentials) as channel:
            with pytest.raises(grpc.RpcError) as info:  # a valid certificate, no token
                worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(),
                                                            timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

        router = processes["router"][0]
        generated = run_cli("generate", "--router", router, "Hello", "--max-tokens", "4",
                            "--token-file", str(token_file), *tls)
        assert generated.returncode == 0, generated.stderr
        assert "completion_tokens=4" in generated.stderr
        refused = run_cli("generate", "--router", router, "Hello", *tls)
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr

        bench_json = tmp_path / "bench.json"
        bench = run_cli("bench", "--router", router, "--concurrency", "2", "--num-requests",
                        "4", "--input-len", "8", "--output-len", "4", "--no-progress",
                        "--json", str(bench_json), "--token-file", str(token_file), *tls)
        assert bench.returncode == 0, bench.stderr
        assert json.loads(bench_json.read_text())["stats"]["num_ok"] == 4
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    wait_gone(children, timeout=10)
    assert not Path(internal_token).exists()  # the private folder goes with the stack
