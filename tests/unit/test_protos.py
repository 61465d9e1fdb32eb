"""The protos lint clean with buf, and the committed stubs are exactly what protogen makes."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_buf_lint_passes():
    buf = shutil.which("buf")
    assert buf, "buf not installed (dev extra: buf-bin)"
    result = subprocess.run([buf, "lint"], cwd=REPO / "protos", capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    # protoc runs in a child process: grpc_tools' protoc and the protobuf library bundled in
    # NIXL's wheel (the nixl extra) crash when loaded into one process (segfault or abort,
    # whichever loads first), and the nixl tests load NIXL into the pytest process.
    result = subprocess.run([sys.executable, "-m", "tandem.protogen", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    fresh = [Path(line) for line in result.stdout.splitlines() if line.strip()]
    assert fresh, "protogen produced nothing"
    for path in fresh:
        committed = REPO / "tandem" / "v1" / path.name
        assert committed.is_file(), f"{committed} is missing: run python -m tandem.protogen"
        assert committed.read_text() == path.read_text(), \
            f"{committed} is stale: run python -m tandem.protogen"


def test_public_rpc_name_is_the_contract():
    from tandem.v1 import generate_pb2

    service = generate_pb2.DESCRIPTOR.services_by_name["Generate"]
    assert service.full_name == "tandem.v1.Generate"
    method = service.methods_by_name["Generate"]
    assert method.server_streaming and not method.client_streaming
