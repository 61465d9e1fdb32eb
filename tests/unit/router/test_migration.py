"""MigrationLog: a fresh worker-side id per attempt, failed workers remembered, and the limit
ending the call with UNAVAILABLE naming every attempt."""
from __future__ import annotations

import grpc
import pytest

from tandem.router.migration import MigrationLog
from tandem.router.validation import RequestError


def test_each_attempt_gets_its_own_request_id_until_the_limit():
    log = MigrationLog("client.abc", migration_limit=2)
    first = log.record_failure("10.0.0.1:1", "decode worker 10.0.0.1:1 failed: UNAVAILABLE")
    second = log.record_failure("10.0.0.2:1", "decode worker 10.0.0.2:1 sent no next token")
    assert [first.request_id, second.request_id, log.current.request_id] == \
        ["client.abc", "client.abc.m1", "client.abc.m2"]
    assert log.num_migrations == 2
    assert log.failed_workers == {"10.0.0.1:1", "10.0.0.2:1"}
    with pytest.raises(RequestError) as info:
        log.record_failure("10.0.0.3:1", "decode worker 10.0.0.3:1 ended the stream")
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert info.value.message.startswith("the request failed on 3 worker(s) "
                                         "(--migration-limit 2): attempt 1: decode worker "
                                         "10.0.0.1:1 failed")
    assert "attempt 3: decode worker 10.0.0.3:1 ended the stream" in info.value.message


def test_limit_zero_fails_on_the_first_failure_and_negative_is_refused():
    log = MigrationLog("x", migration_limit=0)
    with pytest.raises(RequestError, match="--migration-limit 0"):
        log.record_failure("a:1", "prefill worker a:1 failed")
    with pytest.raises(ValueError, match="migration_limit=-1"):
        MigrationLog("x", migration_limit=-1)
