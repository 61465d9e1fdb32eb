"""Loading one rank's model: the checkpoint's config, dtype, device and sharded weights.

Rank 0's engine and every follower rank load through `load_model`, so all ranks agree on the
dtype, the context length and the kernels, and each builds its own shards.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tandem.common.logging import get_logger
from tandem.workers.engine.config import DTYPES, EngineConfig
from tandem.workers.models.loader import build_model, load_hf_config
from tandem.workers.ops.backend import resolve_backend
from tandem.workers.parallel.context import ParallelContext, use_parallel
from tandem.workers.parallel.process_group import rank_device

logger = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    hf_config: Any
    model: nn.Module  # this rank's shards
    dtype: torch.dtype
    device: torch.device  # this rank's device
    max_model_len: int


def load_model(config: EngineConfig, parallel: ParallelContext, hf_config: Any = None
               ) -> LoadedModel:
    """Build `parallel`'s rank of config.model (hf_config: already read, or None to read it)."""
    started = time.monotonic()
    hf_config = hf_config if hf_config is not None else load_hf_config(config.model)
    device = rank_device(config.torch_device(), parallel.tp_rank)
    dtype = _resolve_dtype(config.dtype, hf_config, device)
    max_model_len = _resolve_max_model_len(config.max_model_len, hf_config)
    backend = resolve_backend(config.kernels, device.type)
    logger.info("loading %s (%s) on %s as %s, kernels=%s, TP rank %d of %d%s", config.model,
                ",".join(hf_config.architectures or []), device, str(dtype).split(".")[-1],
                backend.value, parallel.tp_rank, parallel.tp_size,
                ", experts split across ranks" if parallel.is_expert_parallel else "")
    torch.manual_seed(config.seed)
    with use_parallel(parallel):
        model = build_model(hf_config, config.model, dtype, device, backend, config.load_format)
    logger.info("model loaded in %.1f s", time.monotonic() - started)
    return LoadedModel(hf_config, model, dtype, device, max_model_len)


def _resolve_dtype(name: str, hf_config: Any, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    checkpoint = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(checkpoint, str):
        checkpoint = DTYPES.get(checkpoint)
    return checkpoint if checkpoint in DTYPES.values() and checkpoint != torch.float32 \
        else torch.bfloat16


def _resolve_max_model_len(requested: int | None, hf_config: Any) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None)
    if requested is None:
        if limit is None:
            raise ValueError("max_model_len is required: config.json has no "
                             "max_position_embeddings")
        return int(limit)
    if limit is not None and requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's "
                         f"max_position_embeddings={limit}")
    return requested
