"""Build a model from an HF checkpoint folder and load its safetensors weights.

Accepts a single `model.safetensors` or shards listed in `model.safetensors.index.json`.
Every problem with the checkpoint is a ValueError that names the file or tensor.
"""
from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from tandem.common.logging import get_logger
from tandem.workers.models.registry import resolve_model_class
from tandem.workers.ops.backend import KernelBackend

logger = get_logger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Checkpoint tensors that carry nothing the model needs (precomputed RoPE tables).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def load_hf_config(model_path: str | Path) -> Any:
    """The checkpoint's transformers config; ValueError if config.json is missing or unreadable."""
    from transformers import AutoConfig

    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model path {str(path)!r} has no config.json")
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many types for a bad config
        raise ValueError(f"cannot read {path / 'config.json'}: {exc}") from exc


def checkpoint_files(model_path: str | Path) -> list[Path]:
    path = Path(model_path)
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"cannot read {index}: {exc}") from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} lists shard(s) that do not exist: {', '.join(missing)}")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {str(path)!r} (expected {SINGLE_FILE} or "
                         f"{INDEX_FILE})")
    return files


def iter_checkpoint_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as exc:
            raise ValueError(f"cannot open safetensors file {file}: {exc}") from exc
        with handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def _target_of(name: str, packed: dict[str, tuple[str, Any]]) -> tuple[str, Any]:
    """Checkpoint tensor name -> (our parameter name, shard id or None)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            target, shard_id = packed[part]
            return ".".join(parts[:i] + [target] + parts[i + 1:]), shard_id
    return name, None


def _targets_of(model: nn.Module, name: str, packed: dict[str, tuple[str, Any]]
                ) -> list[tuple[str, Any, int | None]]:
    """Checkpoint tensor name -> [(our parameter name, shard id or None, expert id or None)].

    A model may define `map_checkpoint_name(name)` returning such a list (e.g. one expert's
    tensor, or a tensor stacked over all experts) or None to fall back to
    `packed_modules_mapping`.
    """
    mapper = getattr(model, "map_checkpoint_name", None)
    targets = mapper(name) if mapper is not None else None
    if targets is None:
        return [(*_target_of(name, packed), None)]
    return targets


def load_weights(model: nn.Module, model_path: str | Path) -> None:
    """Copy every checkpoint tensor into its parameter; every parameter must be filled."""
    files = checkpoint_files(model_path)
    params = dict(model.named_parameters())  # tied weights appear once, under the embedding
    packed = getattr(model, "packed_modules_mapping", {})
    is_tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    loaded: dict[str, set] = defaultdict(set)
    started = time.monotonic()
    num_bytes = 0
    for name, tensor in iter_checkpoint_tensors(files):
        if name.endswith(_IGNORED_SUFFIXES) or (is_tied and name == "lm_head.weight"):
            continue
        num_bytes += tensor.numel() * tensor.element_size()
        for target, shard_id, expert_id in _targets_of(model, name, packed):
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                                 f"{type(model).__name__}")
            key = shard_id if expert_id is None else (expert_id, shard_id)
            if key in loaded[target]:
                raise ValueError(f"checkpoint tensor {name!r} appears twice")
            loader = getattr(param, "weight_loader", None)
            tensor = tensor.to(param.dtype)  # once, though a stacked tensor has many targets
            try:
                if loader is None:
                    _copy_whole(param, tensor)
                elif expert_id is None:
                    loader(param, tensor, shard_id)
                else:
                    loader(param, tensor, shard_id, expert_id)
            except ValueError as exc:
                raise ValueError(f"checkpoint tensor {name!r}: {exc}") from exc
            loaded[target].add(key)
    missing = [_describe_missing(n, p, loaded[n]) for n, p in params.items()
               if len(loaded[n]) < getattr(p, "num_shards", 1)]
    if missing:
        raise ValueError(f"checkpoint {str(model_path)!r} is missing tensors for: "
                         f"{', '.join(missing)}")
    logger.info("loaded %.1f MB of weights from %d file(s) in %.1f s", num_bytes / 1e6,
                len(files), time.monotonic() - started)


def _describe_missing(name: str, param: nn.Parameter, loaded: set) -> str:
    """The parameter's name, plus which (expert id, shard id) pairs are absent when it lists
    them in `shard_ids` (stacked expert weights)."""
    absent = [key for key in getattr(param, "shard_ids", ()) if key not in loaded]
    if not absent:
        return name
    shown = ", ".join(f"expert {expert} {shard!r}" for expert, shard in absent[:8])
    more = f" and {len(absent) - 8} more" if len(absent) > 8 else ""
    return f"{name} ({shown}{more})"


def _copy_whole(param: nn.Parameter, tensor: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"expected shape {tuple(param.shape)}, checkpoint has "
                         f"{tuple(tensor.shape)}")
    param.data.copy_(tensor.to(param.dtype))


def build_model(config: Any, model_path: str | Path, dtype: torch.dtype,
                device: torch.device, backend: KernelBackend, load_format: str = "auto"
                ) -> nn.Module:
    """Construct the model class for `config` on `device` in `dtype` and load its weights
    (load_format "dummy": fill them with seeded random values instead)."""
    model_cls = resolve_model_class(config)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(config, backend)
    finally:
        torch.set_default_dtype(previous_dtype)
    if load_format == "dummy":
        fill_dummy_weights(model)
    else:
        load_weights(model, model_path)
    return model.eval()


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, scale: float = 0.02) -> None:
    """Random weights in [-scale, scale], made where the parameters live (no host copy).

    Norm weights (names ending in "norm.weight") become 1 + noise so activations keep their
    scale through many layers; the values are for timing, not for text.
    """
    for name, param in model.named_parameters():
        if param.dtype.is_floating_point:
            param.uniform_(-scale, scale)
            if name.endswith("norm.weight"):
                param.add_(1.0)
    logger.info("filled %.1f MB of dummy weights", sum(
        p.numel() * p.element_size() for p in model.parameters()) / 1e6)
