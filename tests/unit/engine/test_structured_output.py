"""Grammar-constrained decoding in the engine: the compile cache, the token mask against a
torch reference, every sampling mode, offline outputs that validate, a request that waits for
its grammar without holding the batch, and a prefill -> decode handoff."""
from __future__ import annotations

import json
import math
import re
from concurrent.futures import Future

import jsonschema
import pytest
import torch
from helpers.checkpoints import VOCAB, random_prompts
from test_disaggregation import run_to_completion, transfer

from tandem import LLM, SamplingParams
from tandem.common.structured_output import StructuredOutput, grammar_error
from tandem.workers.engine.grammar_cache import GrammarCompiler
from tandem.workers.engine.grammar_mask import RequestGrammar
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
    matcher = compiler.compile(spec).result().deep_copy()
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
