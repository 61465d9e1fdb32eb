"""Error types that map to specific gRPC status codes at the service edge.

All are ValueErrors, so in-process callers (the offline API) can catch ValueError alone.
"""
from __future__ import annotations


class OutOfRangeError(ValueError):
    """A value that does not fit the model: prompt longer than max_model_len, token id >= vocab."""


class AlreadyExistsError(ValueError):
    """A request id already in use."""
