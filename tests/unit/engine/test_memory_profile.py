"""The dummy prefill a GPU rank profiles (workers/engine/memory_profile.py) is a real step: on
CPU, through a tiny checkpoint's model bound to the probe caches, each prompt's last logits equal
transformers' for the same tokens, so the profile measures what a real prefill allocates."""
from __future__ import annotations

import torch

from tandem import LLM
from tandem.workers.engine.kv_sizing import blocks_per_seq
from tandem.workers.engine.memory_profile import (_bind_probe_caches, _dummy_prefill,
                                                  _dummy_prompt_lengths)
from tandem.workers.engine.model_runner import attention_layers


def test_prompt_lengths_fill_the_step_budget_within_the_limits():
    assert _dummy_prompt_lengths(2048, 64, 131072) == [2048]
    assert _dummy_prompt_lengths(300, 64, 128) == [128, 128, 44]
    assert _dummy_prompt_lengths(1000, 2, 128) == [128, 128]  # max_num_seqs caps the step


def test_dummy_prefill_through_probe_caches_gives_transformers_logits(checkpoint):
    ckpt = checkpoint("llama")
    model = LLM(ckpt.path, dtype="float32", max_model_len=128, num_kv_blocks=8).engine.model
    lengths = _dummy_prompt_lengths(300, 64, 128)
    num_blocks = sum(blocks_per_seq(n, 16) for n in lengths)
    _bind_probe_caches(model, num_blocks, 16, torch.float32, torch.device("cpu"))
    inputs = _dummy_prefill(lengths, 16, ckpt.model.config.vocab_size, torch.device("cpu"))
    with torch.inference_mode():
        hidden = model(inputs.input_ids, inputs.positions, inputs.meta)
        logits = model.compute_logits(hidden[inputs.logits_indices]).float()  # [3, V]
    assert logits.shape == (3, ckpt.model.config.vocab_size)
    token_ids = inputs.input_ids.tolist()
    start = 0
    for row, n in enumerate(lengths):
        expected = ckpt.logits(token_ids[start:start + n])[-1]
        torch.testing.assert_close(logits[row], expected, atol=2e-4, rtol=2e-4)
        start += n
    _bind_probe_caches(model, 0, 16, torch.float32, torch.device("cpu"))  # frees the probe's
    assert all(cache.numel() == 0 for layer in attention_layers(model)
               for cache in (layer.k_cache, layer.v_cache))
