"""The device's limits measured in the same run as the engine, and the floors derived from them.

    copy bandwidth   bytes read + bytes written by one large device-to-device copy / time
    matmul rate      2 * 8192^3 / time of one bf16 8192^3 matmul
    decode floor     (weight bytes read + KV bytes read) / copy bandwidth
    prefill floor    FLOPs / matmul rate

Every time is the median of several CUDA-event-timed repetitions after a warm-up; inputs are
random, never zeros (zeros can run faster than real data).
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch


def time_cuda(fn: Callable[[], object], *, warmup: int = 3, reps: int = 20, calls: int = 1
              ) -> float:
    """Median seconds per fn() on the current stream, `calls` calls queued back to back between
    two CUDA events per rep. calls=1 times a lone call started from an idle stream, which also
    counts the host's latency in handing the device its first work; a few queued calls give
    the device's own time per call (a share that matters at a few milliseconds a call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def copies_to_defeat_l2(bytes_per_call: int, limit: int = 20) -> int:
    """How many input sets to rotate through so that no call finds its inputs in L2 (3x the
    cache size in flight), as in a model step where each layer's weights and KV are read once."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, min(limit, -(-3 * l2 // max(1, bytes_per_call))))


def time_graphed(fn: Callable[[int], object], *, calls_per_graph: int = 20, reps: int = 10
                 ) -> float:
    """Median seconds per fn(i) when calls i = 0..calls_per_graph-1 replay as one CUDA graph:
    the kernels' own time, without Python launch gaps (how the engine runs decode steps).
    fn gets the call index so it can rotate through input copies (copies_to_defeat_l2)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(0)  # compile / autotune outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(calls_per_graph):
                fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    return time_cuda(graph.replay, reps=reps) / calls_per_graph


@dataclass(frozen=True)
class DeviceLimits:
    name: str
    copy_bytes_per_s: float
    matmul_flops_per_s: float

    def as_dict(self) -> dict:
        return {"device": self.name, "copy_TBps": self.copy_bytes_per_s / 1e12,
                "bf16_matmul_TFLOPs": self.matmul_flops_per_s / 1e12}


def measure_limits(copy_bytes: int = 1 << 30, matmul_n: int = 8192) -> DeviceLimits:
    src = torch.randint(0, 255, (copy_bytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_s = time_cuda(lambda: dst.copy_(src))
    del src, dst
    a = torch.randn(matmul_n, matmul_n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(matmul_n, matmul_n, device="cuda", dtype=torch.bfloat16)
    matmul_s = time_cuda(lambda: a @ b)
    del a, b
    torch.cuda.empty_cache()
    return DeviceLimits(torch.cuda.get_device_name(), 2 * copy_bytes / copy_s,
                        2 * matmul_n ** 3 / matmul_s)


@dataclass(frozen=True)
class ModelShape:
    """What the floors need to know about a model (per layer where layers differ)."""

    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    dense_weight_bytes: int  # every parameter read by every step, lm_head included, the
    #                          input embedding and the routed experts excluded
    expert_bytes: int  # one routed expert of one layer (0 for dense models)
    num_moe_layers: int
    kv_bytes_per_token_layer: int  # K + V of one token in one layer
    dense_flops_per_token: int  # 2 * multiply-adds of the dense weights, lm_head excluded
    expert_flops_per_token: int  # 2 * multiply-adds of the top-k routed experts
    lm_head_flops: int  # per sampled token

    def decode_bytes(self, batch: int, context: int, experts_read: int) -> int:
        """Bytes one decode step must read: weights once, routed experts that were chosen (the
        count summed over layers), and every sequence's KV."""
        kv = batch * context * self.num_layers * self.kv_bytes_per_token_layer
        return self.dense_weight_bytes + experts_read * self.expert_bytes + kv

    def prefill_flops(self, num_tokens: int) -> int:
        """FLOPs of one prompt's prefill: matmuls of every token, causal attention (QK^T and PV
        over the keys each query sees), logits for the last token only."""
        linear = num_tokens * (self.dense_flops_per_token + self.expert_flops_per_token)
        attention = 2 * 2 * self.num_heads * self.head_dim * num_tokens * (num_tokens + 1) // 2
        return linear + attention * self.num_layers + self.lm_head_flops


def shape_of(model: torch.nn.Module, hf_config, top_k: int = 0) -> ModelShape:
    """Derive the floors' inputs from the built model's parameters (not from a formula)."""
    from tandem.workers.ops.moe import FusedMoE

    embed = model.model.embed_tokens.weight
    expert_params = {id(p) for m in model.modules() if isinstance(m, FusedMoE)
                     for p in m.parameters()}
    moe_layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    dense_bytes, dense_flops = 0, 0
    for p in model.parameters():
        if id(p) in expert_params or p is embed and not _tied(hf_config):
            continue
        dense_bytes += p.numel() * p.element_size()
        if p.dim() == 2 and p is not model.lm_head.weight:
            dense_flops += 2 * p.numel()
    expert_bytes = expert_flops = 0
    if moe_layers:
        moe = moe_layers[0]
        per_expert = sum(p[0].numel() for p in (moe.w13, moe.w2))
        expert_bytes = per_expert * moe.w13.element_size()
        expert_flops = 2 * per_expert * top_k * len(moe_layers)
    num_heads, num_kv_heads, head_dim, kv_bytes = _attention_shape(model, embed.element_size())
    return ModelShape(hf_config.num_hidden_layers, hf_config.hidden_size, num_heads,
                      num_kv_heads, head_dim, hf_config.vocab_size, dense_bytes,
                      expert_bytes, len(moe_layers), kv_bytes, dense_flops, expert_flops,
                      2 * hf_config.vocab_size * hf_config.hidden_size)


def _attention_shape(model: torch.nn.Module, itemsize: int) -> tuple[int, int, int, int]:
    """(query heads, KV heads, head_dim, cache bytes per token and layer) of the first
    attention op. MLA (ops/mla.py) caches one latent row of kv_lora_rank + rope dims and no
    per-head K/V: one "KV head"; its head_dim is the mean of the q.k and the v widths, so that
    prefill_flops' 2 * head_dim per query-key pair counts QK^T (Dn + P) plus PV (Dv)."""
    for m in model.modules():
        name = type(m).__name__
        if name == "Attention":
            return (m.num_heads, m.num_kv_heads, m.head_dim,
                    2 * m.num_kv_heads * m.head_dim * itemsize)
        if name == "MLAAttention":
            qk_v = m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim
            return m.num_heads, 1, qk_v // 2, m.latent_dim * itemsize
    raise ValueError("no Attention or MLAAttention module in the model")


def _tied(hf_config) -> bool:
    return bool(getattr(hf_config, "tie_word_embeddings", False))
