"""Grammar replicas: the requests of one grammar spread over independently compiled matchers
(llguidance's deep copies share one locked lexer), as many as there are live requests up to
the cap, with masks equal to those of one shared matcher."""
from __future__ import annotations

import gc
import json
import time
from concurrent.futures import Future

import numpy as np
import pytest
import torch
from helpers.checkpoints import VOCAB

from tandem.bench.structured_host import parse_variant
from tandem.common.sampling_params import SamplingParams
from tandem.common.structured_output import StructuredOutput
from tandem.workers.engine.grammar_cache import CompiledGrammar, GrammarCompiler
from tandem.workers.engine.grammar_mask import GrammarMasker, RequestGrammar
from tandem.workers.engine.sequence import Sequence

EOS = VOCAB - 1
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["ab", "cd"]}}},
    "required": ["name", "n", "tags"], "additionalProperties": False}
SPEC = StructuredOutput("json_schema", json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    """The tiny checkpoint's llguidance tokenizer, loaded once for every compiler here."""
    compiler = GrammarCompiler(checkpoint("llama").path, VOCAB, [EOS])
    yield compiler.tokenizer()
    compiler.shutdown()


@pytest.fixture
def make_compiler(checkpoint, tokenizer):
    compilers = []

    def make(max_replicas: int) -> GrammarCompiler:
        compilers.append(GrammarCompiler(checkpoint("llama").path, VOCAB, [EOS],
                                         max_replicas=max_replicas, tokenizer=tokenizer))
        return compilers[-1]

    yield make
    for compiler in compilers:
        compiler.shutdown()


def constrained(compiler: GrammarCompiler) -> Sequence:
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=64))
    seq.grammar = RequestGrammar(compiler.compile(SPEC))
    return seq


def settle(compiled) -> None:
    deadline = time.monotonic() + 60
    while compiled.num_compiling:
        assert time.monotonic() < deadline, "replicas still compiling after 60 s"
        time.sleep(0.01)


def run_steps(seqs: list[Sequence], num_steps: int, on_step=None) -> list[np.ndarray]:
    """Fills and advances seqs num_steps times, row r taking allowed token r * (step + 1)
    (mod the allowed count), so the rows part ways; each step's [B, W] bitmask."""
    masker = GrammarMasker((EOS,), num_threads=2)
    masks = []
    for step in range(num_steps):
        if on_step is not None:
            on_step(step)
        words = masker.fill(seqs, VOCAB, torch.device("cpu")).numpy().copy()
        masks.append(words)
        for row, seq in enumerate(seqs):
            bits = np.unpackbits(words[row].view(np.uint8), count=VOCAB, bitorder="little")
            allowed = np.flatnonzero(bits)
            token = int(allowed[(row * (step + 1)) % len(allowed)])
            if token == EOS:
                token = int(allowed[0])
            seq.append_token(token)
            assert not seq.grammar.accept(token)
    return masks


def test_requests_of_one_grammar_spread_over_replicas_with_one_matchers_masks(make_compiler):
    """Four requests on a grammar with two replicas: two bound to each; step by step their
    masks equal those of four requests sharing one matcher."""
    shared, spread = make_compiler(1), make_compiler(2)
    runs = {}
    for name, compiler in (("shared", shared), ("spread", spread)):
        seqs = [constrained(compiler) for _ in range(4)]
        compiled = seqs[0].grammar.compiled.result()
        settle(compiled)
        masks = run_steps(seqs, 24)
        runs[name] = masks, [seq.grammar.use.replica for seq in seqs], compiled.num_replicas
    assert runs["shared"][1:] == ([0, 0, 0, 0], 1)
    assert sorted(runs["spread"][1]) == [0, 0, 1, 1] and runs["spread"][2] == 2
    for step, (one, two) in enumerate(zip(runs["shared"][0], runs["spread"][0])):
        assert np.array_equal(one, two), f"step {step}"
    assert any(not np.array_equal(words[0], words[row])  # the rows were in different states
               for words in runs["spread"][0] for row in range(1, 4))


def test_replicas_follow_live_requests_up_to_the_cap(make_compiler):
    """One request keeps one replica; more live requests compile more, never past the cap; a
    request that ends frees its replica for the next one."""
    compiler = make_compiler(3)
    first = constrained(compiler)
    compiled = first.grammar.compiled.result()
    settle(compiled)
    assert compiled.num_replicas == 1
    others = [constrained(compiler) for _ in range(4)]
    settle(compiled)
    assert compiled.num_replicas == 3
    started = [first, *others[:2]]
    for seq in started:
        seq.grammar.start(seq)
    assert sorted(seq.grammar.use.replica for seq in started) == [0, 1, 2]
    ended = others[1].grammar.use.replica
    del others[1], started, seq
    gc.collect()
    late = constrained(compiler)
    late.grammar.start(late)
    assert late.grammar.use.replica == ended
    assert compiled.num_replicas == 3


def test_a_request_created_while_its_grammar_compiles_counts_once_it_has(make_compiler):
    compiler = make_compiler(2)
    waiting = [constrained(compiler) for _ in range(2)]  # the compile has not finished yet
    compiled = waiting[0].grammar.compiled.result()
    settle(compiled)
    assert compiled.num_replicas == 2
    for seq in waiting:
        seq.grammar.start(seq)
    assert sorted(seq.grammar.use.replica for seq in waiting) == [0, 1]


def test_young_requests_move_to_replicas_compiled_after_they_bound(tokenizer, make_compiler):
    """Four requests bind while their grammar has one replica; when the second arrives, two of
    them move to it (their tokens replayed) and every mask stays that of a shared matcher."""
    from llguidance import LLMatcher

    grammar = SPEC.grammar_text()
    held: list = []  # replica compiles, run when the test says
    compiled = CompiledGrammar(LLMatcher(tokenizer, grammar, log_level=0),
                               lambda: LLMatcher(tokenizer, grammar, log_level=0),
                               lambda work: held.append(work) or True, max_replicas=2)
    ready: Future = Future()
    ready.set_result(compiled)
    seqs = [Sequence([1, 2, 3], SamplingParams(max_tokens=64)) for _ in range(4)]
    for seq in seqs:
        seq.grammar = RequestGrammar(ready)
    assert len(held) == 1 and compiled.num_replicas == 1

    def add_replica_at_step_5(step: int) -> None:
        if step == 5:
            held.pop()()
    masks = run_steps(seqs, 24, add_replica_at_step_5)
    assert compiled.num_replicas == 2
    assert sorted(seq.grammar.use.replica for seq in seqs) == [0, 0, 1, 1]
    reference = [constrained(make_compiler(1)) for _ in range(4)]
    for step, (one, two) in enumerate(zip(run_steps(reference, 24), masks)):
        assert np.array_equal(one, two), f"step {step}"


@pytest.mark.parametrize("text,expected", [
    ("default", (None, None)), ("shared:4", (4, 1)), ("replicas:8", (8, 8))])
def test_host_bench_variants(text, expected):
    assert parse_variant(text) == expected


@pytest.mark.parametrize("text", ["shared", "replicas:0", "lanes:2", "shared:x"])
def test_host_bench_rejects_unknown_variants(text):
    with pytest.raises(ValueError, match="--variants"):
        parse_variant(text)
