"""The checkpoint loader: formats it accepts and the errors it gives for broken checkpoints."""
from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from helpers.checkpoints import random_prompts, rewrite_weights

from tandem import LLM, SamplingParams
from tandem.workers.engine.config import EngineConfig


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture_is_named(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint("llama").path, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture FancyNewForCausalLM"):
        LLM(path)


def test_unreadable_config_is_named(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint("llama").path, tmp_path / "ckpt")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        LLM(path)
    with pytest.raises(ValueError, match="has no config.json"):
        LLM(tmp_path / "nowhere")


def test_missing_tensor_is_named(checkpoint, tmp_path):
    path = rewrite_weights(checkpoint("llama").path, tmp_path / "ckpt",
                           lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors for: model\.layers\.1\.self_attn"
                                         r"\.qkv_proj\.weight"):
        LLM(path)


def test_misshaped_tensor_is_named(checkpoint, tmp_path):
    def shrink(tensors):
        name = "model.layers.0.mlp.down_proj.weight"
        tensors[name] = tensors[name][:, :10].contiguous()

    path = rewrite_weights(checkpoint("llama").path, tmp_path / "ckpt", shrink)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*shape"):
        LLM(path)


def test_unexpected_tensor_is_named(checkpoint, tmp_path):
    path = rewrite_weights(checkpoint("llama").path, tmp_path / "ckpt",
                           lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="model.extra.weight"):
        LLM(path)


def test_no_weights_is_named(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint("llama").path, tmp_path / "ckpt")
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no safetensors weights"):
        LLM(path)


@pytest.mark.parametrize("saved_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_load(checkpoint, tmp_path, saved_dtype):
    """A bf16/fp16 checkpoint loads as fp32 (same logits as transformers on the upcast weights)
    and as its own dtype."""
    ckpt = checkpoint("qwen3")
    path = tmp_path / "half"
    copy.deepcopy(ckpt.model).to(saved_dtype).save_pretrained(path)
    reference = type(ckpt.model).from_pretrained(path, dtype=torch.float32).eval()
    [prompt] = random_prompts([20], seed=21)
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12,
                                      min_new_tokens=12, do_sample=False)[0, 20:].tolist()
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    assert LLM(path, dtype="float32").generate([prompt], params)[0].token_ids == expected
    half = LLM(path, dtype=str(saved_dtype).split(".")[-1])
    assert half.engine.model.lm_head.weight.dtype == saved_dtype
    assert len(half.generate([prompt], params)[0].token_ids) == 12


@pytest.mark.parametrize("field,value,message", [
    ("dtype", "int8", "dtype='int8'"),
    ("block_size", 0, "block_size=0"),
    ("kernels", "cuda-magic", "kernels='cuda-magic'"),
    ("max_num_batched_tokens", -1, "max_num_batched_tokens=-1"),
])
def test_bad_engine_config_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="x", **{field: value})


def test_kv_cache_too_small_for_one_sequence(checkpoint):
    with pytest.raises(ValueError, match="num_kv_blocks=2"):
        LLM(checkpoint("llama").path, num_kv_blocks=2, block_size=16, max_model_len=256)


def test_max_model_len_above_model_limit(checkpoint):
    with pytest.raises(ValueError, match="max_position_embeddings=512"):
        LLM(checkpoint("llama").path, max_model_len=100_000)


def test_text_prompt_without_tokenizer_is_named(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint("llama").path, tmp_path / "ckpt")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (path / name).unlink(missing_ok=True)
    llm = LLM(path, dtype="float32")
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello")
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].text == ""
    with_tokenizer = LLM(checkpoint("llama").path, dtype="float32")
    [out] = with_tokenizer.generate("Paris is", SamplingParams(temperature=0, max_tokens=4))
    assert out.text == with_tokenizer.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_dummy_load_format_needs_only_the_config(checkpoint, tmp_path):
    """load_format="dummy" builds the model from config.json alone, with seeded random weights
    (what bench/engine.py uses for full-size shapes), and the engine runs on them."""
    shutil.copy(checkpoint("llama").path / "config.json", tmp_path / "config.json")
    outputs = []
    for _ in range(2):
        llm = LLM(tmp_path, dtype="float32", load_format="dummy", max_model_len=128)
        weights = dict(llm.engine.model.named_parameters())
        norm = weights["model.norm.weight"]
        assert 0.95 < norm.min() and norm.max() < 1.05  # norms near 1, not raw noise
        assert weights["lm_head.weight"].abs().max() <= 0.02 + 1e-6
        [out] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
        outputs.append(out.token_ids)
    assert outputs[0] == outputs[1]  # seeded: the same weights twice
    with pytest.raises(ValueError, match="load_format='safetensors'"):
        EngineConfig(model=str(tmp_path), load_format="safetensors")
