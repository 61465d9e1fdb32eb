"""GPU tests run only where torch sees a CUDA or ROCm device; elsewhere they skip cleanly."""
import gc

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA/ROCm GPU visible to torch")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def give_gpu_memory_back():
    """Engines size their KV cache from the memory free when they start (0.9 of the device by
    default), so each test hands what its engines held back to the device: worker processes
    started by a later test do not see this process's cached blocks as in use."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
