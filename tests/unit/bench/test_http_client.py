"""The HTTP bench client's error mapping and the HTTP-vs-gRPC verdicts (no server needed; the
client's requests are covered against a real router in tests/e2e/test_openai_http_e2e.py)."""
from __future__ import annotations

import grpc
import pytest

from tandem.bench.http_client import HTTPCallError
from tandem.bench.http_vs_grpc import ratios


@pytest.mark.parametrize("status, body, code", [
    (504, b'{"error": {"message": "late", "code": "DEADLINE_EXCEEDED"}}',
     grpc.StatusCode.DEADLINE_EXCEEDED),
    (400, b'{"error": {"message": "bad", "code": "OUT_OF_RANGE"}}',
     grpc.StatusCode.OUT_OF_RANGE),  # the router's gRPC code wins over the HTTP status
    (429, b'{"error": {"message": "full", "code": null}}', grpc.StatusCode.RESOURCE_EXHAUSTED),
    (503, b"<html>proxy error</html>", grpc.StatusCode.UNAVAILABLE),
    (500, b'{"error": {"message": "x", "code": "NOT_A_CODE"}}', grpc.StatusCode.UNKNOWN),
])
def test_http_failures_become_grpc_statuses(status, body, code):
    error = HTTPCallError.from_body(status, body)
    assert isinstance(error, grpc.RpcError) and error.code() == code
    assert error.details().startswith(f"HTTP {status}: ")


def _rows(grpc_ttft, http_ttft, grpc_tpot, http_tpot, grpc_cpu=None, http_cpu=None):
    def row(ttft, tpot, cpu):
        return {"ttft_s": {"mean": ttft}, "tpot_s": {"mean": tpot},
                "router_cpu_s_per_request": cpu}
    return {"grpc": row(grpc_ttft, grpc_tpot, grpc_cpu),
            "http": row(http_ttft, http_tpot, http_cpu)}


def test_ratios_allow_http_five_percent_more_tpot_and_ten_more_ttft():
    within = ratios(_rows(0.100, 0.109, 0.050, 0.052, 2.0, 2.1))
    assert within["ttft_s"]["ok"] and within["tpot_s"]["ok"]
    assert within["tpot_s"]["ratio"] == pytest.approx(1.04)
    assert within["router_cpu"] == pytest.approx(1.05)
    outside = ratios(_rows(0.100, 0.111, 0.050, 0.0526))
    assert not outside["ttft_s"]["ok"] and not outside["tpot_s"]["ok"]
    assert outside["router_cpu"] is None
    faster = ratios(_rows(0.100, 0.080, 0.050, 0.040))  # HTTP adds nothing: targets met
    assert faster["ttft_s"]["ok"] and faster["tpot_s"]["ok"]
    assert not ratios(_rows(0.1, None, 0.05, 0.05))["ttft_s"]["ok"]
