"""Kernel switches are one frozen object decided at start-up (ops/kernel_options.py): the
TANDEM_* variables give EngineConfig's default, worker flags override them, followers get rank
0's, and no op looks at the environment itself."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from tandem.workers.engine.config import EngineConfig
from tandem.workers.ops import kernel_options
from tandem.workers.ops.gpu import cuda_build
from tandem.workers.ops.kernel_options import KERNEL_CACHE, SWITCHES, KernelOptions
from tandem.workers.server import build_parser, engine_config

WORKERS = Path(__file__).resolve().parents[3] / "workers"
WORKER_ARGS = ["--role", "both", "--model", "m", "--port", "1"]


def test_the_environment_gives_the_defaults(monkeypatch):
    assert KernelOptions.from_env({}) == KernelOptions(True, True, True, "")
    env = {"TANDEM_BLOCK_DECODE": "0", "TANDEM_PDL": "1", "TANDEM_ONE_SHOT_ALL_REDUCE": "0",
           KERNEL_CACHE: "/tmp/k"}
    assert KernelOptions.from_env(env) == KernelOptions(False, True, False, "/tmp/k")
    assert KernelOptions.from_env(env).kernel_cache_dir == Path("/tmp/k")
    assert KernelOptions.from_env({"TANDEM_MOE_DECODE": "0"}).moe_decode is False
    assert KernelOptions.from_env({}).moe_prefill is True
    assert KernelOptions.from_env({"TANDEM_MOE_PREFILL": "0"}).moe_prefill is False
    assert KernelOptions.from_env({}).fa4_prefill is True
    assert KernelOptions.from_env({"TANDEM_FA4_PREFILL": "0"}).fa4_prefill is False
    monkeypatch.setenv("TANDEM_PDL", "0")
    assert EngineConfig(model="m").kernel_options.pdl is False


def test_a_bad_switch_names_its_variable():
    with pytest.raises(ValueError, match="TANDEM_PDL='off' must be 0 or 1"):
        KernelOptions.from_env({"TANDEM_PDL": "off"})
    with pytest.raises(ValueError, match="block_decode=1 must be True or False"):
        KernelOptions(block_decode=1)


def test_worker_flags_override_the_environment(monkeypatch):
    monkeypatch.setenv("TANDEM_BLOCK_DECODE", "0")
    monkeypatch.setenv(KERNEL_CACHE, "/from/env")
    options = engine_config(build_parser().parse_args(WORKER_ARGS)).kernel_options
    assert options == KernelOptions(False, True, True, "/from/env")
    args = build_parser().parse_args([*WORKER_ARGS, "--block-decode", "--no-pdl",
                                      "--kernel-cache", "/k"])
    assert engine_config(args).kernel_options == KernelOptions(True, False, True, "/k")


def test_followers_get_rank_0s_options():
    """A follower rebuilds EngineConfig from rank 0's as JSON (executor/followers.py)."""
    config = EngineConfig(model="m", kernel_options=KernelOptions(False, False, False, "/k"))
    again = EngineConfig(**json.loads(json.dumps(dataclasses.asdict(config))))
    assert again == config


def test_ops_read_the_installed_options(monkeypatch):
    installed = kernel_options.current()
    try:
        kernel_options.install(KernelOptions(kernel_cache="/installed"))
        monkeypatch.setenv(KERNEL_CACHE, "/changed/later")
        assert cuda_build._cache_dir() == Path("/installed")
    finally:
        kernel_options.install(installed)


def test_no_op_reads_the_switches_from_the_environment():
    names = "|".join([*SWITCHES.values(), KERNEL_CACHE])
    lookup = re.compile(rf"environ(\.get)?[(\[]\s*[\"']({names})[\"']")
    readers = [str(path.relative_to(WORKERS)) for path in WORKERS.rglob("*.py")
               if lookup.search(path.read_text())]
    assert readers == []  # ops/kernel_options.py reads them through SWITCHES and KERNEL_CACHE
