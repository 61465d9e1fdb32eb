"""bench/burst.py against bench/overload.py's stand-in that refuses every call: real client
processes and a real grpc.aio server, as the overload bench and the refusal probe use them."""
from __future__ import annotations

from tandem.bench.burst import run_burst
from tandem.bench.overload import InstantRefuserProcess


def test_a_burst_from_several_processes_reports_every_call_timed_from_its_own_send():
    prompts = [[5 + index, 6, 7] for index in range(12)]
    phases = []
    with InstantRefuserProcess() as stand_in:
        outcome = run_burst(stand_in.address, prompts, max_tokens=4, num_processes=3,
                            on_phase=phases.append)
    assert phases == ["start", "end"]
    assert len(outcome.calls) == len(prompts)
    assert len(outcome.refused) == len(prompts) and not outcome.failed
    for call in outcome.calls:
        assert call.sent <= call.ended
        assert call.retry_after_ms == 100
        assert "always full" in call.details
