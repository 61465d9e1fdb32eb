"""Model classes keyed by the `architectures` names of HF checkpoints (config.json)."""
from __future__ import annotations

import importlib
from typing import Any

# HF architecture name -> (module under tandem.workers.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "Glm4MoeForCausalLM": ("glm4_moe", "Glm4MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v3", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("deepseek_v32", "DeepseekV32ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(config: Any) -> type:
    """The model class for a checkpoint's config; ValueError naming an unknown architecture."""
    architectures = list(getattr(config, "architectures", None) or [])
    if not architectures:
        raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
    for name in architectures:
        if name in _MODELS:
            module_name, class_name = _MODELS[name]
            module = importlib.import_module(f"tandem.workers.models.{module_name}")
            return getattr(module, class_name)
    raise ValueError(f"unsupported architecture {', '.join(architectures)}; supported: "
                     f"{', '.join(supported_architectures())}")
