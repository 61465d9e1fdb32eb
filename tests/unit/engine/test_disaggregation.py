"""Prefill on one engine, decode on another, KV moved as byte payloads: the tokens must be the
ones a single engine (and transformers) gives. Both engines run real models in this process."""
from __future__ import annotations

import pytest
from helpers.checkpoints import PARITY_LENGTHS, random_prompts

from tandem import LLM, SamplingParams
from tandem.workers.engine.model_runner import kv_cache_kind
from tandem.workers.engine.sequence import SequenceStatus
from tandem.workers.kv.block_payload import PayloadWriter, iter_payload_chunks
from tandem.common.kv_layout import KVLayout, KVLayoutMismatch

GREEDY = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)


def run_to_completion(engine):
    while engine.has_unfinished:
        engine.step()


def transfer(prefill, decode, prompt, params, request_id, chunk_bytes=4096):
    """Prefill -> pin -> reserve -> pull the blocks the decode side lacks -> release -> activate."""
    seq = prefill.add_request(prompt, params, request_id, pin_after_prefill=True)
    run_to_completion(prefill)
    assert seq.status is SequenceStatus.PINNED and request_id in prefill.pinned
    target = decode.reserve_prefilled(prompt, seq.completion_token_ids, params, request_id)
    assert target is not None
    block_size = decode.config.block_size
    start_block = target.num_cached_tokens // block_size
    num_blocks = -(-len(prompt) // block_size)
    writer = PayloadWriter(decode.runner.kv_caches, target.block_table[start_block:num_blocks])
    for chunk in iter_payload_chunks(prefill.runner.kv_caches,
                                     seq.block_table[start_block:num_blocks], chunk_bytes):
        writer.write(*chunk)
    writer.check_complete()
    assert prefill.release(request_id)
    decode.activate_prefilled(target, len(prompt))
    return target


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_prefill_here_decode_there_matches_transformers(checkpoint, variant):
    ckpt = checkpoint(variant)
    prefill = LLM(ckpt.path, dtype="float32", max_num_batched_tokens=64).engine
    decode = LLM(ckpt.path, dtype="float32").engine
    prompts = random_prompts(PARITY_LENGTHS, seed=41)
    seqs = [transfer(prefill, decode, p, GREEDY, f"r{i}") for i, p in enumerate(prompts)]
    run_to_completion(decode)
    for prompt, seq in zip(prompts, seqs):
        assert seq.completion_token_ids == ckpt.greedy(prompt, 24)
    for engine in (prefill, decode):
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert not engine.requests


@pytest.mark.parametrize("variant,kind", [("deepseek_v3", "mla"), ("deepseek_v3_yarn", "mla"),
                                          ("deepseek_v32", "mla_indexer")])
def test_latent_cache_handoff_matches_transformers(moe_checkpoint, variant, kind):
    """MLA: one latent tensor per layer crosses over, and decode attends over it absorbed.
    DeepSeek-V3.2: the indexer keys cross with it, and decode selects its sparse keys there."""
    ckpt = moe_checkpoint(variant)
    prefill = LLM(ckpt.path, dtype="float32", max_num_batched_tokens=64).engine
    decode = LLM(ckpt.path, dtype="float32").engine
    assert KVLayout.from_kv_caches(decode.runner.kv_caches,
                                   kind=kv_cache_kind(decode.model)).kind == kind
    prompts = random_prompts(PARITY_LENGTHS, seed=46)
    seqs = [transfer(prefill, decode, p, GREEDY, f"m{i}") for i, p in enumerate(prompts)]
    run_to_completion(decode)
    for prompt, seq in zip(prompts, seqs):
        assert seq.completion_token_ids == ckpt.greedy(prompt, 24)


def test_decode_side_prefix_hits_skip_the_pull(checkpoint):
    ckpt = checkpoint("llama")
    prefill = LLM(ckpt.path, dtype="float32").engine
    decode = LLM(ckpt.path, dtype="float32").engine
    [prompt] = random_prompts([100], seed=42)
    transfer(prefill, decode, prompt, GREEDY, "a")
    run_to_completion(decode)
    second = transfer(prefill, decode, prompt, GREEDY, "b")
    assert second.num_cached_tokens == 96  # 6 full blocks of 16 found locally
    run_to_completion(decode)
    assert second.completion_token_ids == ckpt.greedy(prompt, 24)


def test_seeded_sampling_continues_across_engines(checkpoint):
    ckpt = checkpoint("llama")
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=20, min_tokens=20)
    [prompt] = random_prompts([30], seed=43)
    single = LLM(ckpt.path, dtype="float32")
    [expected] = single.generate([prompt], params)
    prefill = LLM(ckpt.path, dtype="float32").engine
    decode = LLM(ckpt.path, dtype="float32").engine
    seq = transfer(prefill, decode, prompt, params, "s")
    run_to_completion(decode)
    assert seq.completion_token_ids == expected.token_ids


def test_unreleased_pin_expires_and_frees_blocks(checkpoint):
    prefill = LLM(checkpoint("llama").path, dtype="float32", kv_lease_seconds=5.0).engine
    [prompt] = random_prompts([50], seed=44)
    seq = prefill.add_request(prompt, GREEDY, "p", pin_after_prefill=True)
    run_to_completion(prefill)
    assert seq.status is SequenceStatus.PINNED
    held = prefill.block_manager.num_blocks - prefill.block_manager.num_free_blocks
    assert held == 4
    assert prefill.expire_leases(now=seq.first_token_time + 1.0) == []
    assert prefill.expire_leases(now=seq.first_token_time + 6.0) == ["p"]
    assert prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks
    assert prefill.num_expired_leases == 1 and not prefill.release("p")


def test_pinned_event_names_the_blocks_and_the_lease_deadline(checkpoint):
    """What a prefill worker's KV handle carries for cuda-ipc (no LeaseKV round trip)."""
    from tandem.workers.async_engine import _event

    prefill = LLM(checkpoint("llama").path, dtype="float32", kv_lease_seconds=5.0).engine
    [prompt] = random_prompts([50], seed=45)
    seq = prefill.add_request(prompt, GREEDY, "p", pin_after_prefill=True)
    run_to_completion(prefill)
    event = _event(seq, prefill.pinned)
    assert event.is_pinned and len(event.kv_blocks) == 4
    assert list(event.kv_blocks) == seq.block_table
    assert event.lease_deadline == prefill.pinned["p"] == seq.first_token_time + 5.0
    prefill.release("p")
    assert _event(seq, prefill.pinned).kv_blocks == ()


def test_abort_frees_pinned_and_receiving_requests(checkpoint):
    ckpt = checkpoint("llama")
    prefill = LLM(ckpt.path, dtype="float32").engine
    decode = LLM(ckpt.path, dtype="float32").engine
    [prompt] = random_prompts([40], seed=45)
    seq = prefill.add_request(prompt, GREEDY, "x", pin_after_prefill=True)
    run_to_completion(prefill)
    target = decode.reserve_prefilled(prompt, seq.completion_token_ids, GREEDY, "x")
    assert prefill.abort("x") and decode.abort("x")
    assert target.status is SequenceStatus.FINISHED
    for engine in (prefill, decode):
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_layout_mismatch_names_the_fields(checkpoint):
    engine = LLM(checkpoint("llama").path, dtype="float32").engine
    mine = KVLayout.from_kv_caches(engine.runner.kv_caches)
    assert mine.as_dict()["kind"] == "mha" and mine.num_layers == 2
    other = KVLayout("mha", 2, 32, mine.num_kv_heads, mine.head_dim, "bfloat16")
    with pytest.raises(KVLayoutMismatch, match="block_size: source 32 != receiver 16.*dtype"):
        other.check_readable_by(mine)
    mine.check_readable_by(mine)


def test_mha_worker_refuses_an_mla_workers_blocks(checkpoint, moe_checkpoint):
    mha = KVLayout.from_kv_caches(LLM(checkpoint("llama").path, dtype="float32")
                                  .engine.runner.kv_caches)
    mla = KVLayout.from_kv_caches(LLM(moe_checkpoint("deepseek_v3").path, dtype="float32")
                                  .engine.runner.kv_caches)
    assert (mla.kind, mla.num_kv_heads, mla.head_dim) == ("mla", 1, 40)
    with pytest.raises(KVLayoutMismatch, match="source keeps a 'mla' KV cache and this worker "
                                               "a 'mha' one"):
        mla.check_readable_by(mha)


def test_deepseek_v32_and_v3_workers_refuse_each_others_blocks(moe_checkpoint):
    """Latents without indexer keys would leave a V3.2 decode selecting keys from zeros."""
    v32 = LLM(moe_checkpoint("deepseek_v32").path, dtype="float32").engine
    v3 = LLM(moe_checkpoint("deepseek_v3").path, dtype="float32").engine
    dsa, mla = (KVLayout.from_kv_caches(e.runner.kv_caches, kind=kv_cache_kind(e.model))
                for e in (v32, v3))
    assert (dsa.kind, dsa.head_dim, dsa.index_head_dim) == ("mla_indexer", 40, 32)
    assert (mla.kind, mla.head_dim, mla.index_head_dim) == ("mla", 40, 0)
    with pytest.raises(KVLayoutMismatch, match="source keeps a 'mla' KV cache and this worker "
                                               "a 'mla_indexer' one.*indexer keys"):
        mla.check_readable_by(dsa)
    with pytest.raises(KVLayoutMismatch, match="index_head_dim: source 32 != receiver 0"):
        dsa.check_readable_by(mla)


def test_prefilled_requests_wait_for_blocks_in_order_as_waiting_for_remote_kvs(checkpoint):
    """A request prefilled elsewhere queues outside scheduling until its blocks are free, then
    holds them (RECEIVING); requests queued after it wait behind it even where they would
    fit; abort takes a queued one out, and every block comes back."""
    engine = LLM(checkpoint("llama").path, dtype="float32", num_kv_blocks=8,
                 max_model_len=128).engine  # 8 blocks of 16 tokens
    big, mid, small = random_prompts([100, 60, 10], seed=46)  # 7, 4 and 1 blocks
    first = engine.queue_prefilled(big, [1], GREEDY, "big")
    assert first.status is SequenceStatus.WAITING_FOR_REMOTE_KVS and not first.block_table
    assert engine.reserve_remote() == [first] and first.status is SequenceStatus.RECEIVING
    second = engine.queue_prefilled(mid, [1], GREEDY, "mid")
    third = engine.queue_prefilled(small, [1], GREEDY, "small")
    assert engine.reserve_remote() == []  # "small" would fit, but waits behind "mid"
    assert engine.reserve_prefilled(small, [1], GREEDY, "other") is None
    assert third.status is SequenceStatus.WAITING_FOR_REMOTE_KVS and not engine.has_unfinished
    assert engine.abort("big")
    assert engine.reserve_remote() == [second, third]
    fourth = engine.queue_prefilled(big, [1], GREEDY, "again")
    assert engine.reserve_remote() == []
    for request_id in ("again", "mid", "small"):
        assert engine.abort(request_id)
    assert fourth.status is SequenceStatus.FINISHED and not engine.scheduler.waiting_for_remote_kvs
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
