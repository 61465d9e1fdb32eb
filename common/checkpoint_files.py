"""Facts read straight from an HF checkpoint folder, shared by the router and the workers."""
from __future__ import annotations

import json
from pathlib import Path


def eos_token_ids(model_path: str | Path, config_eos: int | list[int] | None) -> frozenset[int]:
    """EOS ids from generation_config.json when present (what transformers' generate uses),
    else config.json's `config_eos`. ValueError if generation_config.json is unreadable."""
    eos = config_eos
    gen_path = Path(model_path) / "generation_config.json"
    if gen_path.is_file():
        try:
            eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
        except json.JSONDecodeError as exc:
            raise ValueError(f"cannot read {gen_path}: {exc}") from exc
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
