"""Switches for our GPU kernels: one frozen object per worker, decided at start-up.

    options = KernelOptions.from_env()     # EngineConfig's default (worker flags override it)
    kernel_options.install(options)        # once per process, before the model loads
    kernel_options.current().pdl           # what the ops read (no environment lookups)

Fields, each with the environment variable that gives its default:

    block_decode         TANDEM_BLOCK_DECODE=0 turns off the whole-block CUDA decode kernel
                         (ops/attention_gpu.py; the split-KV Triton kernel runs instead)
    pdl                  TANDEM_PDL=0 turns off programmatic dependent launch (ops/gpu/pdl.py)
    one_shot_all_reduce  TANDEM_ONE_SHOT_ALL_REDUCE=0 sends every TP all-reduce through NCCL
                         (parallel/one_shot_all_reduce.py)
    moe_decode           TANDEM_MOE_DECODE=0 sends decode-sized MoE batches through AITER's
                         fused_moe too (ops/moe.py; the decode kernels are ops/gpu/moe_decode.py)
    moe_prefill          TANDEM_MOE_PREFILL=0 sends larger MoE batches through AITER's
                         fused_moe rather than our grouped GEMMs (ops/moe.py ->
                         ops/gpu/moe_prefill.py)
    fa4_prefill          TANDEM_FA4_PREFILL=0 keeps prefills on torch SDPA and AITER's
                         unified_attention where FlashAttention-4 is installed
                         (ops/gpu/fa4_prefill.py)
    kernel_cache         TANDEM_KERNEL_CACHE: where our CUDA C++ kernels are built
                         (ops/gpu/cuda_build.py); empty: ~/.cache/tandem/kernels

The environment is read in `from_env` only; an unset variable gives the field's default. A
switch accepts 0 or 1 (ValueError naming the
variable otherwise). Every rank of a worker installs the same options (the followers get
rank 0's EngineConfig).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

SWITCHES = {"block_decode": "TANDEM_BLOCK_DECODE", "pdl": "TANDEM_PDL",
            "one_shot_all_reduce": "TANDEM_ONE_SHOT_ALL_REDUCE",
            "moe_decode": "TANDEM_MOE_DECODE", "moe_prefill": "TANDEM_MOE_PREFILL",
            "fa4_prefill": "TANDEM_FA4_PREFILL"}
KERNEL_CACHE = "TANDEM_KERNEL_CACHE"


@dataclass(frozen=True, slots=True)
class KernelOptions:
    block_decode: bool = True
    pdl: bool = True
    one_shot_all_reduce: bool = True
    kernel_cache: str = ""
    moe_decode: bool = True
    moe_prefill: bool = True
    fa4_prefill: bool = True

    def __post_init__(self) -> None:
        for name in SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> KernelOptions:
        defaults = {f.name: f.default for f in fields(cls)}
        return cls(**{name: _switch(environ, var, defaults[name])
                      for name, var in SWITCHES.items()},
                   kernel_cache=environ.get(KERNEL_CACHE, ""))

    @property
    def kernel_cache_dir(self) -> Path:
        return Path(self.kernel_cache or Path.home() / ".cache" / "tandem" / "kernels")


def _switch(environ: Mapping[str, str], var: str, default: bool) -> bool:
    value = environ.get(var, "1" if default else "0")
    if value not in ("0", "1"):
        raise ValueError(f"{var}={value!r} must be 0 or 1")
    return value == "1"


_installed: KernelOptions | None = None


def install(options: KernelOptions) -> None:
    """This process's options, for every op from now on (at start-up, before any kernel)."""
    global _installed
    _installed = options


def current() -> KernelOptions:
    """The installed options; a process that installed none (a test, a probe) gets the
    environment's, read once."""
    global _installed
    if _installed is None:
        _installed = KernelOptions.from_env()
    return _installed
