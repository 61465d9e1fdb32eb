"""The engine's settings (given) and the values derived from the model and machine (resolved)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.workers.engine.kv_sizing import check_gpu_memory_utilization
from tandem.workers.ops.backend import KERNEL_CHOICES
from tandem.workers.ops.kernel_options import KernelOptions

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOAD_FORMATS = ("auto", "dummy")
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                 "half": "float16"}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the user chose. Validated here; every bad value is a ValueError naming its field."""

    model: str
    # auto (the checkpoint's dtype; float32 on CPU) | float32 | bfloat16 | float16
    dtype: str = "auto"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    kernels: str = "auto"  # auto | torch | aiter-triton | aiter
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    block_size: int = 16
    # Overrides the sizing: on a GPU from gpu_memory_utilization (engine/memory_profile.py),
    # on CPU from kv_cache_memory_bytes; both capped by what max_num_seqs full-length sequences
    # need.
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 2 << 30  # on CPU only
    # The fraction of the GPU's memory this engine may use for weights, activations, CUDA
    # graphs and KV; the KV cache gets what the rest leaves.
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # prompts longer than this are prefilled in chunks
    seed: int = 0
    # A prefill worker frees pinned KV that no decode worker released within this many seconds.
    kv_lease_seconds: float = 30.0
    # auto: the checkpoint's safetensors; dummy: random weights made on the device (benchmarks
    # of full-size shapes need only a config.json).
    load_format: str = "auto"
    # GPU decode steps replay CUDA graphs (aiter-triton kernels); True runs every step eagerly.
    enforce_eager: bool = False
    # With decode graphs on one rank: a step of one prompt with up to this many new tokens
    # (and max_num_batched_tokens) prefills by replaying a CUDA graph padded to a bucket
    # (prefill_graphs.py says which steps); its launches otherwise cost more host time than
    # its kernels take. 0 turns them off.
    prefill_graph_tokens: int = 2048
    # Queue decode step N+1 on the device before reading step N's tokens (engine.py). None: on
    # for a one-rank GPU engine; True also on CPU (nothing to gain there; tests use it).
    async_scheduling: bool | None = None
    # Ranks (processes) this engine's model is split across; rank 0 runs the engine.
    tensor_parallel_size: int = 1
    # With TP > 1: each rank holds whole experts (E / TP of them) instead of a slice of each.
    enable_expert_parallel: bool = False
    # Switches for our GPU kernels (ops/kernel_options.py); the TANDEM_* variables by default.
    kernel_options: KernelOptions = field(default_factory=KernelOptions.from_env)

    def __post_init__(self) -> None:
        dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        object.__setattr__(self, "dtype", dtype)
        if dtype != "auto" and dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of auto, {', '.join(DTYPES)}")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels={self.kernels!r} is not one of {', '.join(KERNEL_CHOICES)}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens",
                     "kv_cache_memory_bytes", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens={self.prefill_graph_tokens} must be >= 0")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 1")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={self.load_format!r} is not one of "
                             f"{', '.join(LOAD_FORMATS)}")
        if not self.kv_lease_seconds > 0:
            raise ValueError(f"kv_lease_seconds={self.kv_lease_seconds} must be > 0")
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling={self.async_scheduling!r} must be None, True "
                             f"or False")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel={self.enable_expert_parallel!r} must be "
                             f"True or False")
        check_gpu_memory_utilization(self.gpu_memory_utilization)
        if isinstance(self.kernel_options, dict):  # as dataclasses.asdict gave it (followers)
            object.__setattr__(self, "kernel_options", KernelOptions(**self.kernel_options))
        if not isinstance(self.kernel_options, KernelOptions):
            raise ValueError(f"kernel_options={self.kernel_options!r} is not a KernelOptions")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} must be >= 1")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            return torch.device(self.device)
        except RuntimeError as exc:
            raise ValueError(f"device={self.device!r} is not a torch device: {exc}") from exc


@dataclass(frozen=True, slots=True)
class ResolvedConfig:
    """Values derived at start-up from the checkpoint and the machine."""

    max_model_len: int
    num_kv_blocks: int
    dtype: torch.dtype
    device: torch.device
    vocab_size: int
    eos_token_ids: frozenset[int]
