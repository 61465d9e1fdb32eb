"""Grammar-constrained decoding in the engine: the compile cache, the token mask against a
torch reference, every sampling mode, offline outputs that validate, a request that waits for
its grammar without holding the batch, and a prefill -> decode handoff."""
from __future__ import annotations

import json
import math
import re
from concurrent.futures import Future

import jsonschema
import numpy as np
import pytest
import torch
from helpers.checkpoints import VOCAB, random_prompts
from test_disaggregation import run_to_completion, transfer

from tandem import LLM, SamplingParams
from tandem.common.structured_output import StructuredOutput, grammar_error
from tandem.workers.engine.grammar_cache import GrammarCompiler
from tandem.workers.engine.grammar_mask import (GrammarMasker, RequestGrammar, bit_values,
                                                mask_with_numpy_, mask_with_tensor_ops_)
from tandem.workers.engine.sampler import Sampler
from tandem.workers.engine.sequence import Sequence

EOS = VOCAB - 1
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[a-z]{2,6}-[0-9]{1,3}$"},
        "kind": {"enum": ["cat", "dog", "fox"]},
        "owner": {"type": "object",
                  "properties": {"name": {"type": "string", "maxLength": 8},
                                 "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                  "required": ["name", "age"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "kind", "owner", "tags", "ok"],
    "additionalProperties": False,
}
SCHEMA_SPEC = StructuredOutput("json_schema", json.dumps(SCHEMA))
CHOICE_SPEC = StructuredOutput("choice", choices=("yes", "no", "maybe \"so\""))


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint("llama").path, dtype="float32")


@pytest.fixture(scope="module")
def compiler(checkpoint):
    compiler = GrammarCompiler(checkpoint("llama").path, VOCAB, [EOS])
    yield compiler
    compiler.shutdown()


def allowed_tokens(compiler: GrammarCompiler, spec: StructuredOutput,
                   prefix: list[int]) -> set[int]:
    """The reference: tokens the grammar accepts after prefix, one try_consume per token
    (independent of the bitmask and its unpacking)."""
    matcher = compiler.compile(spec).result().unbound_matcher()
    assert matcher.consume_tokens(prefix)
    allowed = set()
    for token in range(VOCAB):
        probe = matcher.deep_copy()
        if token == EOS:
            if probe.is_accepting():
                allowed.add(token)
        elif probe.try_consume_tokens([token]) == 1:
            allowed.add(token)
    return allowed


def constrained_seq(compiler, spec, params: SamplingParams, prefix=()) -> Sequence:
    seq = Sequence([1, 2, 3], params)
    seq.token_ids.extend(prefix)
    seq.grammar = RequestGrammar(compiler.compile(spec))
    return seq


def test_cache_shares_one_compile_per_grammar_text(compiler):
    before_compiles, before_hits = compiler.num_compiles, compiler.num_cache_hits
    spec = StructuredOutput("regex", r"[0-9]{2}z")
    first = compiler.compile(spec)
    again = compiler.compile(StructuredOutput("regex", r"[0-9]{2}z"))
    assert again is first and first.result() is again.result()
    assert compiler.compile(StructuredOutput("regex", r"[0-9]{3}z")) is not first
    assert compiler.num_compiles == before_compiles + 2
    assert compiler.num_cache_hits == before_hits + 1


def test_cache_drops_least_recently_used(checkpoint):
    compiler = GrammarCompiler(checkpoint("llama").path, VOCAB, [EOS], max_cached=2)
    try:
        a = compiler.compile(StructuredOutput("regex", "a"))
        b = compiler.compile(StructuredOutput("regex", "b"))
        assert compiler.compile(StructuredOutput("regex", "a")) is a  # a is now the newest
        compiler.compile(StructuredOutput("regex", "c"))  # evicts b
        assert compiler.compile(StructuredOutput("regex", "a")) is a
        assert compiler.compile(StructuredOutput("regex", "b")) is not b
    finally:
        compiler.shutdown()


@pytest.mark.parametrize("spec,fragment", [
    (StructuredOutput("regex", "a(b"), "unclosed group"),
    (StructuredOutput("json_schema", '{"type": "strin"}'), "strin"),
    (StructuredOutput("grammar", "start: missing_rule"), "missing_rule"),
])
def test_a_spec_that_does_not_compile_fails_naming_the_problem(compiler, spec, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        compiler.compile(spec).result()
    assert fragment in grammar_error(spec) and grammar_error(spec).startswith(
        f"structured_output.{spec.kind}")


def test_grammar_error_accepts_good_specs():
    for spec in (SCHEMA_SPEC, CHOICE_SPEC, StructuredOutput("json_object"),
                 StructuredOutput("regex", "[a-z]+"),
                 StructuredOutput("grammar", 'start: "x" num\nnum: /[0-9]+/')):
        assert grammar_error(spec) is None, spec


def test_mask_matches_the_reference_and_keeps_relative_probabilities(compiler, checkpoint):
    prefix: list[int] = []
    sampler = Sampler([EOS], seed=0)
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 3
    seqs = [constrained_seq(compiler, SCHEMA_SPEC, SamplingParams()),
            Sequence([1, 2, 3], SamplingParams()),
            constrained_seq(compiler, CHOICE_SPEC, SamplingParams())]
    masked = logits.clone()
    sampler._grammar_masker.apply_(masked, seqs)
    assert torch.equal(masked[1], logits[1])  # an unconstrained row is untouched
    for row, spec in ((0, SCHEMA_SPEC), (2, CHOICE_SPEC)):
        allowed = allowed_tokens(compiler, spec, prefix)
        assert allowed and len(allowed) < VOCAB
        keep = torch.zeros(VOCAB, dtype=torch.bool)
        keep[list(allowed)] = True
        assert torch.isneginf(masked[row][~keep]).all()
        assert torch.equal(masked[row][keep], logits[row][keep])
        expected = torch.softmax(logits[row][keep], dim=-1)  # renormalized over the allowed
        torch.testing.assert_close(torch.softmax(masked[row], dim=-1)[keep], expected)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, logprobs=5),
    SamplingParams(temperature=1.3, seed=7, logprobs=3),
    SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, repetition_penalty=1.5, frequency_penalty=1.0,
                   presence_penalty=-1.0),
], ids=["greedy", "seeded", "truncated", "penalties"])
def test_every_sampling_mode_samples_only_allowed_tokens(compiler, params):
    """Whatever the sampling mode, the sampled token and every reported top logprob are
    grammar-allowed, and logprobs are those of the masked distribution."""
    sampler = Sampler([EOS], seed=3)
    prefix = [91, 2]  # '{"' in the tiny tokenizer: inside the object, before a key
    allowed = allowed_tokens(compiler, SCHEMA_SPEC, prefix)
    for step in range(20):
        logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(step)) * 4
        seqs = [constrained_seq(compiler, SCHEMA_SPEC, params, prefix),
                Sequence([5, 6], params)]
        out = sampler(logits, seqs)
        assert out.token_ids[0] in allowed
        if params.logprobs is not None:
            entry = out.logprobs[0]
            assert {token for token, _ in entry.top_logprobs} <= allowed
            keep = torch.tensor(sorted(allowed))
            reference = torch.log_softmax(logits[0][keep], dim=-1)
            expected = reference[keep.tolist().index(out.token_ids[0])].item()
            assert math.isclose(entry.logprob, expected, rel_tol=1e-4, abs_tol=1e-5)


def validates(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def test_offline_outputs_validate_greedy_and_sampled(llm):
    prompts = random_prompts([3, 9, 17, 30], seed=5)
    params = [SamplingParams(temperature=0, max_tokens=200, structured_output=SCHEMA_SPEC),
              SamplingParams(temperature=1.0, seed=11, max_tokens=200,
                             structured_output=SCHEMA_SPEC)]
    outputs = llm.generate(prompts * 2, [params[0]] * 4 + [params[1]] * 4)
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        assert validates(out.text), out.text
        assert EOS not in out.token_ids  # the grammar ended the request, not an EOS


def test_offline_choice_and_regex(llm):
    prompts = random_prompts([4, 11], seed=6)
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=20,
                                                structured_output=CHOICE_SPEC))
    assert all(o.text in CHOICE_SPEC.choices and o.finish_reason == "stop" for o in outs)
    regex = StructuredOutput("regex", r"[0-9]{3}-[a-c]{1,4}")
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=20,
                                                structured_output=regex))
    assert all(re.fullmatch(regex.spec, o.text) for o in outs), [o.text for o in outs]


def test_offline_bad_grammar_is_a_value_error_and_leaks_nothing(llm):
    with pytest.raises(ValueError, match="prompt 1: structured_output.regex"):
        llm.generate([[1, 2], [3, 4]], [SamplingParams(),
                                        SamplingParams(structured_output=StructuredOutput(
                                            "regex", "(("))])
    assert not llm.engine.requests and not llm.engine.has_unfinished
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_a_compiling_grammar_does_not_hold_the_batch(llm, monkeypatch):
    engine = llm.engine
    real = engine.grammars.compile(CHOICE_SPEC).result()
    gate: Future = Future()
    monkeypatch.setattr(engine.grammars, "compile", lambda spec: gate)
    waiting = engine.add_request([1, 2, 3], SamplingParams(max_tokens=8,
                                                           structured_output=CHOICE_SPEC))
    free = engine.add_request([4, 5, 6], SamplingParams(temperature=0, max_tokens=3,
                                                        ignore_eos=True))
    while not free.is_finished:
        engine.step()
    assert waiting.num_completion_tokens == 0 and waiting in engine.awaiting_grammar
    assert engine.has_unfinished
    gate.set_result(real)
    run_to_completion(engine)
    assert waiting.finish_reason.value == "stop"
    assert llm.tokenizer.decode(waiting.completion_token_ids) in CHOICE_SPEC.choices


def test_prefill_there_decode_here_gives_one_engines_tokens(checkpoint, llm):
    """The decode engine rebuilds the matcher from the prefill's first token."""
    prefill = LLM(checkpoint("llama").path, dtype="float32").engine
    prompts = random_prompts([5, 40], seed=8)
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=3, max_tokens=200,
                                structured_output=SCHEMA_SPEC)
        single = llm.generate(prompts, params)
        for i, prompt in enumerate(prompts):
            seq = transfer(prefill, llm.engine, prompt, params, f"split-{temperature}-{i}")
            run_to_completion(llm.engine)
            assert seq.completion_token_ids == single[i].token_ids
            assert seq.finish_reason.value == "stop"


def test_both_mask_paths_match_llguidances_reference():
    """The numpy path (CPU logits) and the tensor-op path a GPU runs (run here on CPU) set
    exactly the logits llguidance's own numpy reference sets to -inf, and no others."""
    from llguidance.numpy import apply_token_bitmask_inplace

    rng = np.random.default_rng(0)
    words = rng.integers(-2**31, 2**31, size=(5, -(-VOCAB // 32)), dtype=np.int64) \
        .astype(np.int32)
    words[1] = 0  # nothing allowed
    words[2] = -1  # everything allowed
    logits = torch.randn(5, VOCAB)
    expected = logits.numpy().copy()
    apply_token_bitmask_inplace(expected, words.copy())
    by_numpy, by_tensor_ops = logits.clone(), logits.clone()
    mask_with_numpy_(by_numpy, torch.from_numpy(words.copy()))
    mask_with_tensor_ops_(by_tensor_ops, torch.from_numpy(words.copy()),
                          bit_values(torch.device("cpu")))
    assert torch.equal(by_numpy, torch.from_numpy(expected))
    assert torch.equal(by_tensor_ops, torch.from_numpy(expected))
    token = 37
    assert bool(torch.isneginf(by_numpy[0, token])) != bool(
        (int(words[0, token // 32]) >> (token % 32)) & 1)


def test_the_reused_bitmask_forgets_rows_that_are_no_longer_constrained(compiler):
    """The host bitmask is kept across steps: a row constrained in one step and
    unconstrained (or another request's) in the next is untouched by the earlier mask, and a
    batch larger than any before grows it."""
    masker = GrammarMasker((EOS,))
    logits = torch.randn(4, VOCAB)
    constrained = [constrained_seq(compiler, CHOICE_SPEC, SamplingParams()) for _ in range(2)]
    free = [Sequence([1, 2, 3], SamplingParams()) for _ in range(4)]
    first = logits[:2].clone()
    masker.apply_(first, constrained)
    assert torch.isneginf(first).any(dim=1).all()
    second = logits.clone()
    masker.apply_(second, [free[0], constrained[0], free[1], free[2]])
    assert torch.equal(second[[0, 2, 3]], logits[[0, 2, 3]])
    assert torch.equal(torch.isneginf(second[1]), torch.isneginf(first[0]))
    third = torch.randn(6, VOCAB)
    masked = third.clone()
    masker.apply_(masked, [*free, *constrained])
    assert torch.equal(masked[:4], third[:4])
    assert torch.equal(torch.isneginf(masked[4:]), torch.isneginf(first))


def test_reserve_retries_waiting_for_blocks_count_the_request_once(checkpoint):
    """A decode worker retries reserve_prefilled while blocks are short; only the reservation
    that succeeds counts as a constrained request and a cache lookup."""
    engine = LLM(checkpoint("llama").path, dtype="float32", num_kv_blocks=4,
                 max_model_len=64).engine
    assert engine.reserve_prefilled(list(range(1, 21)), [5], SamplingParams(), "hog")
    params = SamplingParams(max_tokens=8, structured_output=CHOICE_SPEC)
    hits = engine.grammars.num_cache_hits
    for _ in range(3):  # 41 tokens need 3 blocks; 2 are free
        assert engine.reserve_prefilled(list(range(1, 41)), [5], params, "big") is None
    assert engine.num_constrained_requests == 0 and engine.grammars.num_cache_hits == hits
    assert list(engine.requests) == ["hog"]
    assert engine.reserve_prefilled([1, 2, 3], [5], params, "small") is not None
    assert engine.num_constrained_requests == 1


def test_a_request_waiting_for_its_grammar_can_be_aborted_or_expire(llm, monkeypatch):
    engine = llm.engine
    gate: Future = Future()
    monkeypatch.setattr(engine.grammars, "compile", lambda spec: gate)
    params = SamplingParams(max_tokens=8, structured_output=CHOICE_SPEC)
    aborted = engine.add_request([1, 2, 3], params, "aborted")
    expired = engine.add_request([1, 2, 3], params, "expired", deadline=0.0)
    assert engine.abort("aborted") and aborted.finish_reason.value == "abort"
    engine.step()  # drops the expired one before scheduling
    assert expired.is_finished and not engine.awaiting_grammar and not engine.requests
    assert not engine.has_unfinished
    gate.set_exception(ValueError("never needed"))


@pytest.mark.slow
def test_the_extra_slices_give_llguidances_default_masks(tmp_path):
    """The compiler's tokenizer carries extra slices (short string runs); with the real Llama 3
    tokenizer, its masks equal those of llguidance's default slices at every token of a
    document whose strings run up to their maxLength."""
    import llguidance.hf
    from helpers.real_tokenizers import unpack_tokenizer
    from llguidance import LLMatcher
    from transformers import AutoTokenizer

    unpack_tokenizer("deepseek-r1-distill-llama-8b", tmp_path)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    vocab_size = 128_256
    schema = {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "city": {"type": "string", "maxLength": 5},
        "note": {"type": "string"}}, "required": ["name", "city", "note"],
        "additionalProperties": False}}
    document = [{"name": "gasket 12", "city": "Turin", "note": "ships on Monday"},
                {"name": "pulley wheel", "city": "Oslo", "note": "x"},
                {"name": "a", "city": "Rome", "note": "two short words, then a longer one"}]
    tokens = hf_tokenizer.encode(json.dumps(document, separators=(",", ":")),
                                 add_special_tokens=False)
    spec = StructuredOutput("json_schema", json.dumps(schema))
    compiler = GrammarCompiler(tmp_path, vocab_size, [hf_tokenizer.eos_token_id])
    try:
        ours = compiler.compile(spec).result().unbound_matcher()
    finally:
        compiler.shutdown()
    default = LLMatcher(llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size),
                        spec.grammar_text(), log_level=0)
    for token in tokens:
        assert ours.compute_bitmask() == default.compute_bitmask()
        assert ours.consume_token(token) and default.consume_token(token)
    assert ours.is_accepting()
