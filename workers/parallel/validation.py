"""Does a model split over tensor_parallel_size ranks? Checked on rank 0 before any follower
starts, so a bad size fails fast with a ValueError naming the field and the model's number."""
from __future__ import annotations

from typing import Any

# transformers' names for the number of routed experts, by family
_EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def num_routed_experts(hf_config: Any) -> int:
    for name in _EXPERT_COUNT_FIELDS:
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def check_parallel_fits(hf_config: Any, tensor_parallel_size: int,
                        enable_expert_parallel: bool) -> None:
    tp = tensor_parallel_size
    if tp == 1:
        return
    num_heads = hf_config.num_attention_heads
    if num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's "
                         f"num_attention_heads={num_heads}")
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} and the model's num_key_value_heads="
                         f"{num_kv_heads}: one must divide the other (KV heads are split "
                         f"across ranks, or replicated when fewer than the ranks)")
    num_experts = num_routed_experts(hf_config)
    if enable_expert_parallel and num_experts and num_experts % tp:
        raise ValueError(f"enable_expert_parallel with tensor_parallel_size={tp}: the model's "
                         f"{num_experts} experts do not split evenly across the ranks")
