"""Tiny transformers models saved as real checkpoints, plus their reference greedy outputs."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

VOCAB = 384
MAX_POS = 512

_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POS,
             initializer_range=0.1, eos_token_id=VOCAB - 1, bos_token_id=0)

# name -> (architecture, config overrides, save_pretrained kwargs)
CHECKPOINT_VARIANTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "llama": ("llama", {}, {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}, {}),
    # Llama 3.1 rope scaling with a short original context so prompts reach the scaled band.
    "llama_rope3": ("llama", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, "head_dim": 32, "num_attention_heads": 2,
        "num_key_value_heads": 1}, {}),
    "llama_sharded": ("llama", {"attention_bias": True}, {"max_shard_size": "100KB"}),
    "qwen3": ("qwen3", {"head_dim": 32}, {}),
    # head_dim 128: the shapes the whole-block decode kernel serves (ops/attention_gpu.py)
    "llama_h128": ("llama", {"head_dim": 128}, {}),
    "qwen3_h128": ("qwen3", {"head_dim": 128}, {}),  # with QK norm
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True, "head_dim": 16}, {}),
}


@dataclass
class TinyCheckpoint:
    name: str
    path: Path
    model: Any  # the transformers model, fp32, eval mode
    _greedy_cache: dict = field(default_factory=dict)

    def greedy(self, prompt: list[int], num_tokens: int) -> list[int]:
        """transformers' greedy continuation (EOS suppressed so every run is num_tokens long)."""
        key = (tuple(prompt), num_tokens)
        if key not in self._greedy_cache:
            with torch.no_grad():
                out = self.model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens,
                                          min_new_tokens=num_tokens, do_sample=False)
            self._greedy_cache[key] = out[0, len(prompt):].tolist()
        return self._greedy_cache[key]

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """transformers' logits at every position: [len, V] fp32."""
        with torch.no_grad():
            return self.model(torch.tensor([token_ids])).logits[0].float()


# architecture -> (transformers config class, model class) names
_ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
}


def build_checkpoint(name: str, directory: Path, variants: dict | None = None,
                     base: dict | None = None) -> TinyCheckpoint:
    """Build variants[name] (default: CHECKPOINT_VARIANTS over the dense base config)."""
    import transformers

    arch, overrides, save_kwargs = (variants or CHECKPOINT_VARIANTS)[name]
    config_name, model_name = _ARCHITECTURES[arch]
    config_cls, model_cls = getattr(transformers, config_name), getattr(transformers, model_name)
    torch.manual_seed(sum(map(ord, name)))
    config = config_cls(**{**(_BASE if base is None else base), **overrides})
    model = model_cls(config).eval()
    model.save_pretrained(directory, **save_kwargs)
    save_tiny_tokenizer(Path(directory))
    return TinyCheckpoint(name, Path(directory), model)


_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
    "Tandem serves language models: a router, prefill workers and decode workers.",
    "Unicode too: héllo wörld, naïve café, 世界你好, emoji 🤖🚀✨, Ελληνικά, русский.",
    "def generate(prompt, max_tokens=16):\n    return model(prompt)[:max_tokens]\n",
] * 8
CHAT_TEMPLATE = ("{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def save_tiny_tokenizer(directory: Path) -> None:
    """A real byte-level BPE tokenizer with exactly VOCAB ids: <|bos|> = 0, <|eos|> = VOCAB-1
    (the tiny configs' ids), trained deterministically on a small corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 1, special_tokens=["<|bos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(_CORPUS, trainer)
    fillers = [f"<|unused{i}|>" for i in range(VOCAB - 1 - tokenizer.get_vocab_size())]
    tokenizer.add_tokens(fillers)
    tokenizer.add_special_tokens(["<|eos|>"])
    assert tokenizer.token_to_id("<|eos|>") == VOCAB - 1, tokenizer.get_vocab_size()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|bos|>",
                                   eos_token="<|eos|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = VOCAB - 1) -> list[list[int]]:
    """Prompts of the given lengths with ids below the EOS id."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


# Eight prompt lengths from 1 to 300 tokens, used by every parity test.
PARITY_LENGTHS = [1, 7, 16, 33, 64, 129, 200, 300]


def paged_prefill_logits(engine, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position from one paged prefill through Tandem's engine: [len, V]."""
    from tandem import SamplingParams
    from tandem.workers.engine.scheduler import ScheduledSequence, SchedulerOutput
    from tandem.workers.engine.sequence import Sequence

    seq = Sequence(token_ids, SamplingParams(temperature=0))
    engine.block_manager.allocate(seq)
    try:
        inputs = engine.runner.prepare_inputs(
            SchedulerOutput([ScheduledSequence(seq, len(token_ids), True)], is_prefill=True))
        with torch.inference_mode():
            hidden = engine.model(inputs.input_ids, inputs.positions, inputs.meta)
            return engine.model.compute_logits(hidden)
    finally:
        engine.block_manager.free(seq)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def assert_logits_parity(ckpt: TinyCheckpoint, prompt_len: int = 300,
                         num_new_tokens: int = 32) -> None:
    """One paged prefill over a prompt + transformers' greedy completion: Tandem's logits at
    every position within 1e-4 (relative to the largest) of transformers' (fp32)."""
    from tandem import LLM

    engine = LLM(ckpt.path, dtype="float32", block_size=16).engine
    [prompt] = random_prompts([prompt_len], seed=2)
    tokens = prompt + ckpt.greedy(prompt, num_new_tokens)
    assert relative_error(paged_prefill_logits(engine, tokens), ckpt.logits(tokens)) < 1e-4


def assert_greedy_parity(llm, ckpt: TinyCheckpoint, prompts: list[list[int]],
                         num_new_tokens: int = 32) -> None:
    """Tandem's greedy continuation of every prompt equals transformers' (EOS held off)."""
    from tandem import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=num_new_tokens, min_tokens=num_new_tokens)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert out.token_ids == ckpt.greedy(prompt, num_new_tokens), \
            f"prompt of {len(prompt)} tokens diverged"
        assert out.finish_reason == "length"


def assert_chunked_prefill_parity(ckpt: TinyCheckpoint, num_new_tokens: int = 32) -> None:
    """48-token chunks attend to the cache of earlier chunks; the second round finds the shared
    120-token prefix in the prefix cache and prefills only the rest over it. Both rounds give
    transformers' greedy tokens."""
    from tandem import LLM, SamplingParams

    llm = LLM(ckpt.path, dtype="float32", block_size=16, max_num_batched_tokens=48)
    [prefix] = random_prompts([120], seed=3)
    prompts = [prefix + tail for tail in random_prompts([1, 9, 40, 75], seed=4)]
    params = SamplingParams(temperature=0, max_tokens=num_new_tokens, min_tokens=num_new_tokens)
    for round_ in range(2):
        outputs = llm.generate(prompts, params)
        for prompt, out in zip(prompts, outputs):
            assert out.token_ids == ckpt.greedy(prompt, num_new_tokens), \
                f"round {round_}: prompt of {len(prompt)} tokens diverged"
    assert all(out.num_cached_tokens >= 112 for out in outputs)  # 7 full blocks of the prefix


def rewrite_weights(src: Path, dst: Path, edit) -> Path:
    """Copy a single-file checkpoint to dst and apply edit(tensors) to its weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def build_qwen3_with_real_tokenizer(directory: Path) -> Path:
    """A tiny random Qwen3 whose tokenizer and chat template are Qwen3's own (vocab 151,669,
    <tool_call> markers as single tokens, the tools section in the template): what tool calling
    and chat-format tests need. Embeddings are tied to keep the checkpoint small."""
    import transformers
    from helpers.real_tokenizers import unpack_tokenizer

    unpack_tokenizer("qwen-3", directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = transformers.Qwen3Config(**{
        **_BASE, "vocab_size": len(tokenizer), "tie_word_embeddings": True, "head_dim": 16,
        "eos_token_id": eos, "bos_token_id": None})
    torch.manual_seed(3)
    transformers.Qwen3ForCausalLM(config).eval().save_pretrained(directory)
    return Path(directory)
