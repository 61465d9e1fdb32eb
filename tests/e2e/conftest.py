"""Real stacks of processes on 127.0.0.1, shared per module to keep start-ups few."""
from __future__ import annotations

import pytest
from helpers.processes import start_stack, stop


@pytest.fixture(scope="module")
def pd_stack(checkpoint, tmp_path_factory):
    """router -> 1 prefill -> 1 decode on the tiny Llama (with its BPE tokenizer)."""
    ckpt = checkpoint("llama")
    stack = start_stack(ckpt.path, tmp_path_factory.mktemp("pd_logs"),
                        worker_args=["--kv-lease-seconds", "2"])
    yield stack
    stop(stack.processes)


@pytest.fixture(scope="module")
def both_stack(checkpoint, tmp_path_factory):
    """router -> 1 aggregated (--role both) worker."""
    ckpt = checkpoint("llama")
    stack = start_stack(ckpt.path, tmp_path_factory.mktemp("both_logs"), num_prefill=0,
                        num_decode=0, num_both=1)
    yield stack
    stop(stack.processes)
