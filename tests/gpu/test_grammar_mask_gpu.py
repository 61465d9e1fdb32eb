"""The grammar mask on GPU logits (pinned host bitmask, asynchronous copy, tensor-op mask)
sets exactly the logits the CPU path sets, step after step with the rows changing, and a
constrained generation on the GPU validates."""
from __future__ import annotations

import json

import torch
from helpers.checkpoints import VOCAB, random_prompts

from tandem import LLM, SamplingParams
from tandem.common.structured_output import StructuredOutput
from tandem.workers.engine.grammar_cache import GrammarCompiler
from tandem.workers.engine.grammar_mask import GrammarMasker, RequestGrammar
from tandem.workers.engine.sequence import Sequence

EOS = VOCAB - 1
SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["cat", "dog"]},
    # Bounded, so that a random model's sampling ends every string and the array in time.
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
    "required": ["kind", "tags"], "additionalProperties": False}
SPECS = (StructuredOutput("json_schema", json.dumps(SCHEMA)),
         StructuredOutput("choice", choices=("yes", "no")),
         StructuredOutput("regex", r"[0-9]{2,4}"))


def test_gpu_masks_equal_the_cpu_masks_across_steps(checkpoint):
    compiler = GrammarCompiler(checkpoint("llama").path, VOCAB, [EOS])
    on_gpu, on_cpu = GrammarMasker((EOS,)), GrammarMasker((EOS,))
    generator = torch.Generator().manual_seed(0)
    try:
        for step, batch in enumerate((3, 5, 2, 7, 7)):
            seqs = []
            for row in range(batch):
                seq = Sequence([1, 2, 3], SamplingParams())
                if (row + step) % 3:  # the constrained rows move between steps
                    seq.grammar = RequestGrammar(compiler.compile(SPECS[(row + step) % 3]))
                seqs.append(seq)
            logits = torch.randn(batch, VOCAB, generator=generator)
            expected, got = logits.clone(), logits.cuda()
            on_cpu.apply_(expected, seqs)
            on_gpu.apply_(got, seqs)
            assert torch.equal(got.cpu(), expected), step
            assert torch.isneginf(expected).any()
    finally:
        compiler.shutdown()


def test_gpu_constrained_generation_validates(checkpoint):
    llm = LLM(checkpoint("llama").path, dtype="float32", device="cuda")
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=120,
                            structured_output=SPECS[0])
    for out in llm.generate(random_prompts([4, 9, 17, 30], seed=9), params):
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)  # the schema, checked by hand (no jsonschema on GPU boxes)
        assert set(value) == {"kind", "tags"} and value["kind"] in ("cat", "dog")
        assert all(isinstance(tag, str) for tag in value["tags"])
