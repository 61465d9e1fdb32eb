"""The KV cache sizing arithmetic (workers/engine/kv_sizing.py) and its errors, with the sizes
of an 8B model (llama3-8b shape: 2 MiB per 16-token bf16 block, ~15 GiB of weights) on an
80 GiB GPU, and the CPU / override paths an engine takes without a GPU."""
from __future__ import annotations

import pytest

from tandem import LLM
from tandem.workers.engine.kv_sizing import (GiB, MemoryProfile, fixed_kv_cache, size_kv_cache,
                                             size_kv_cache_from_budget)

MiB = 1 << 20
BLOCK_BYTES = 32 * 2 * 16 * 8 * 128 * 2  # layers x (K, V) x tokens x KV heads x head dim x bf16
H100 = 80 * GiB


def profile(total=H100, others=GiB // 2, weights=15 * GiB, activations=2 * GiB,
            reserved=GiB) -> MemoryProfile:
    return MemoryProfile(total_bytes=total, used_by_others_bytes=others, weights_bytes=weights,
                         peak_activation_bytes=activations, reserved_bytes=reserved)


def size(memory: MemoryProfile, fraction=0.9, max_model_len=8192, max_num_seqs=64,
         bytes_per_block=BLOCK_BYTES):
    return size_kv_cache(memory, gpu_memory_utilization=fraction,
                         bytes_per_block=bytes_per_block, block_size=16,
                         max_model_len=max_model_len, max_num_seqs=max_num_seqs)


def test_default_fraction_gives_the_kv_cache_what_weights_and_activations_leave():
    kv = size(profile())
    budget = int(0.9 * H100)
    assert BLOCK_BYTES == 2 * MiB
    assert kv.num_blocks == (budget - 18 * GiB) // BLOCK_BYTES == 27648  # not 2 GiB's 1024
    assert kv.num_tokens == 27648 * 16 and kv.kv_bytes == 27648 * BLOCK_BYTES
    assert kv.kv_bytes + 18 * GiB <= budget < kv.kv_bytes + 18 * GiB + BLOCK_BYTES
    assert kv.max_full_length_seqs == 27648 / 512
    assert kv.describe() == ("KV cache: 27648 blocks = 442368 tokens (54.00 GiB); 54.00 "
                             "sequences of max_model_len=8192 fit")


def test_two_workers_at_045_share_a_gpu_and_a_second_at_09_is_refused():
    first = size(profile(), fraction=0.45)
    first_uses = 15 * GiB + 2 * GiB + GiB + first.kv_bytes
    assert first_uses <= 0.45 * H100
    second = size(profile(others=GiB // 2 + first_uses), fraction=0.45)
    assert second.num_blocks == first.num_blocks
    with pytest.raises(ValueError) as error:
        size(profile(others=GiB // 2 + first_uses), fraction=0.9)
    message = str(error.value)
    assert "gpu_memory_utilization=0.9 asks for 72.00 GiB of the device's 80.00 GiB" in message
    assert "36.50 GiB are already in use" in message and "at most 0.54" in message


def test_weights_that_do_not_fit_name_their_size_and_the_budget():
    with pytest.raises(ValueError, match=r"the weights \(15.00 GiB\) do not fit in "
                                         r"gpu_memory_utilization=0.15 x 80.00 GiB = 12.00 GiB"):
        size(profile(), fraction=0.15)


def test_too_little_kv_for_one_full_length_sequence_names_every_size():
    # 0.25 x 80 = 20 GiB - 18 GiB leaves 2 GiB = 1024 blocks; 131072 tokens need 8192 blocks.
    with pytest.raises(ValueError) as error:
        size(profile(), fraction=0.25, max_model_len=131072)
    message = str(error.value)
    for part in ("gpu_memory_utilization=0.25 x 80.00 GiB = 20.00 GiB", "leaves 2.00 GiB for KV",
                 "weights 15.00 GiB", "activations 2.00 GiB", "reserve 1.00 GiB",
                 "1024 blocks, fewer than the 8192 (16.00 GiB)", "max_model_len=131072"):
        assert part in message, part
    # Weights and activations past the budget leave nothing (never a negative count).
    with pytest.raises(ValueError, match="leaves 0.00 GiB for KV"):
        size(profile(activations=10 * GiB), fraction=0.25)
    assert size(profile(), fraction=0.25, max_model_len=2048).num_blocks == 1024


@pytest.mark.parametrize("fraction", [0, -0.5, 1.01, 9])
def test_fractions_outside_zero_to_one_are_refused(fraction):
    with pytest.raises(ValueError, match=rf"gpu_memory_utilization={fraction} must be in "
                                         r"\(0, 1\]"):
        size(profile(total=H100, others=0), fraction=fraction)


def test_the_whole_device_is_allowed_when_nothing_else_uses_it():
    kv = size(profile(others=0), fraction=1.0)
    assert kv.num_blocks == (H100 - 18 * GiB) // BLOCK_BYTES


def test_gpu_cache_never_outgrows_max_num_seqs_full_length_sequences():
    # A tiny model (4 KiB blocks) would get 70 GiB / 4 KiB = millions of blocks.
    tiny = profile(weights=MiB, activations=MiB, reserved=GiB)
    assert size(tiny, max_model_len=512, max_num_seqs=8, bytes_per_block=4096).num_blocks == 256
    # An 8B model at max_model_len 2048: 64 x 128 blocks (16 GiB) of the 54 GiB left.
    assert size(profile(), max_model_len=2048).num_blocks == 64 * 128


def test_cpu_budget_is_capped_by_what_max_num_seqs_full_sequences_need():
    capped = size_kv_cache_from_budget(2 * GiB, max_num_seqs=4, bytes_per_block=64 * 1024,
                                       block_size=16, max_model_len=256)
    assert capped.num_blocks == 4 * 16  # not 2 GiB / 64 KiB = 32768
    full = size_kv_cache_from_budget(2 * GiB, max_num_seqs=64, bytes_per_block=BLOCK_BYTES,
                                     block_size=16, max_model_len=8192)
    assert full.num_blocks == 1024
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=2147483648 holds 1024 blocks"):
        size_kv_cache_from_budget(2 * GiB, max_num_seqs=64, bytes_per_block=BLOCK_BYTES,
                                  block_size=16, max_model_len=131072)


def test_num_kv_blocks_overrides_and_must_hold_one_sequence():
    assert fixed_kv_cache(20000, bytes_per_block=BLOCK_BYTES, block_size=16,
                          max_model_len=8192).num_blocks == 20000
    with pytest.raises(ValueError, match="num_kv_blocks=100 holds 1600 tokens, fewer than "
                                         "max_model_len=8192"):
        fixed_kv_cache(100, bytes_per_block=BLOCK_BYTES, block_size=16, max_model_len=8192)


def test_engine_config_refuses_a_bad_fraction_and_cpu_keeps_its_byte_budget(checkpoint):
    ckpt = checkpoint("llama")
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=1.5 must be in \(0, 1\]"):
        LLM(ckpt.path, dtype="float32", gpu_memory_utilization=1.5)
    engine = LLM(ckpt.path, dtype="float32", max_model_len=256, max_num_seqs=3,
                 gpu_memory_utilization=0.1).engine  # ignored on CPU
    assert engine.resolved.num_kv_blocks == 3 * 16
