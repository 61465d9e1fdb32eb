"""Shared fixtures: tiny HF checkpoints built with transformers and saved to disk.

Nothing is downloaded: each checkpoint is a randomly initialised model from a small config,
saved with `save_pretrained`, so tests load real safetensors files through the real loader.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # make tests/helpers importable

from helpers.checkpoints import CHECKPOINT_VARIANTS, build_checkpoint  # noqa: E402
from helpers.moe_checkpoints import build_moe_checkpoint  # noqa: E402

# Tiny models run fastest on one thread, and several test processes share 2 CI cores: more
# threads only oversubscribe them (measured: a parity test went from 25 s to 4.5 s).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> TinyCheckpoint, built once per session per variant name."""
    built = {}

    def get(name: str):
        if name not in built:
            built[name] = build_checkpoint(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory):
    """moe_checkpoint(name) -> TinyCheckpoint of a tiny mixture-of-experts model."""
    built = {}

    def get(name: str):
        if name not in built:
            built[name] = build_moe_checkpoint(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get


@pytest.fixture(scope="session")
def default_model_cache(tmp_path_factory):
    """A Tandem cache dir holding the converted default model (converted once per session)."""
    from tandem.common.default_model import ensure_default_model

    cache_dir = tmp_path_factory.mktemp("tandem-cache")
    ensure_default_model(cache_dir)
    return cache_dir


def pytest_report_header(config):
    return f"tiny checkpoint variants: {', '.join(CHECKPOINT_VARIANTS)}"
