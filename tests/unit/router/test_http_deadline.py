"""HTTPDeadline: an HTTP completion's deadline from X-Request-Timeout or the router's default."""
from __future__ import annotations

import pytest
from starlette.requests import Request

from tandem.router.openai_api import HTTPDeadline, HTTPError


def _request(headers: dict[str, str]) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/v1/completions",
                    "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]})


def test_the_header_sets_the_deadline_else_the_default():
    assert 9 < HTTPDeadline.of(_request({"X-Request-Timeout": "10"}), 600).time_remaining() <= 10
    assert 599 < HTTPDeadline.of(_request({}), 600).time_remaining() <= 600
    assert HTTPDeadline.of(_request({}), None).time_remaining() is None
    # The header may also lengthen the default: it is the caller's deadline, as gRPC's is.
    assert HTTPDeadline.of(_request({"X-Request-Timeout": "900"}), 600).time_remaining() > 600


def test_a_passed_deadline_has_no_time_left_and_says_so():
    deadline = HTTPDeadline(1e-9)
    assert deadline.time_remaining() <= 0
    error = deadline.expired()
    assert (error.status, error.code) == (504, "DEADLINE_EXCEEDED")


@pytest.mark.parametrize("value", ["", "abc", "0", "-3", "inf", "nan"])
def test_a_header_that_is_no_positive_number_is_refused(value):
    with pytest.raises(HTTPError) as info:
        HTTPDeadline.of(_request({"X-Request-Timeout": value}), 600)
    assert (info.value.status, info.value.param) == (400, "X-Request-Timeout")
