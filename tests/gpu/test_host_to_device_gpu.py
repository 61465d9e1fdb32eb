"""Step values reach the device and sampled values come back, whether the step runs
synchronously (pageable copies) or queued ahead (pinned, non-blocking copies)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from tandem.workers.engine.host_to_device import as_device_tensor, queued_copies
from tandem.workers.engine.sampler import DeviceSample

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("queued", [False, True])
def test_copies_behind_a_busy_device_keep_their_values(queued):
    device = torch.device("cuda:0")
    sent, received = [], []
    with queued_copies() if queued else contextlib.nullcontext():
        for i in range(100):
            if i % 20 == 0:
                torch.cuda._sleep(20_000_000)  # the queued copies wait behind it
            values = list(range(i, i + 1 + i % 17))
            sent.append(values)
            received.append(as_device_tensor(values, torch.int64, device))
    torch.cuda.synchronize()
    assert [t.tolist() for t in received] == sent


@pytest.mark.parametrize("queued", [False, True])
def test_device_samples_read_back_after_a_busy_device(queued):
    device = torch.device("cuda:0")
    torch.cuda._sleep(20_000_000)
    ids = torch.arange(5, device=device) * 3
    with queued_copies() if queued else contextlib.nullcontext():
        sample = DeviceSample(ids)
    assert sample.to_host().token_ids == [0, 3, 6, 9, 12]
