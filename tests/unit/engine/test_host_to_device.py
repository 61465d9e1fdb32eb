"""host_to_device: which copies may skip waiting for the device, and that values arrive."""
from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
import torch

from tandem.workers.engine.host_to_device import (as_device_tensor, copies_are_queued,
                                                  queued_copies)


def test_queued_copies_nests_and_restores_even_when_the_block_raises():
    assert not copies_are_queued()
    with queued_copies():
        assert copies_are_queued()
        with queued_copies():
            assert copies_are_queued()
        assert copies_are_queued()
    assert not copies_are_queued()
    with pytest.raises(RuntimeError), queued_copies():
        raise RuntimeError("step failed")
    assert not copies_are_queued()


def test_the_flag_belongs_to_the_thread_that_set_it():
    seen = []
    with queued_copies():
        worker = threading.Thread(target=lambda: seen.append(copies_are_queued()))
        worker.start()
        worker.join()
    assert seen == [False]


@pytest.mark.parametrize("queued", [False, True])
def test_values_keep_their_dtype_and_shape(queued):
    cpu = torch.device("cpu")
    with queued_copies() if queued else contextlib.nullcontext():
        nested = as_device_tensor([[1, 2], [3, 4]], torch.int32, cpu)
        from_numpy = as_device_tensor(np.arange(3), torch.float32, cpu)
        empty = as_device_tensor([], torch.int64, cpu)
    assert nested.dtype == torch.int32 and nested.tolist() == [[1, 2], [3, 4]]
    assert from_numpy.dtype == torch.float32 and from_numpy.tolist() == [0.0, 1.0, 2.0]
    assert empty.numel() == 0
