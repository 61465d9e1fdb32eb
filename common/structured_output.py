"""What shape a request's output must take, and the llguidance grammar that enforces it.

Shared by the router (which compile-checks a request's spec before any worker sees it), the
workers (which compile it into token masks) and the offline `LLM`. A spec is one of:

    json_schema  a JSON Schema (text); the output is one JSON value that validates against it
    json_object  any JSON object
    regex        the whole output matches the regular expression (Rust `regex` syntax)
    grammar      a Lark grammar in llguidance's dialect (EBNF-like; `start` is the root rule)
    choice       exactly one of the given strings

`grammar_text()` turns a spec into llguidance's grammar text; the text is also the compile
cache's key, so two requests asking for the same shape share one compiled grammar.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
# A spec's text beyond this many characters is refused: compiling it could take seconds.
MAX_SPEC_CHARS = 100_000
MAX_CHOICES = 1_000
# JSON comes out compact (no whitespace between tokens): a model cannot spend its tokens on
# blank space. A schema's own "x-guidance" options override this.
_JSON_DEFAULTS = {"whitespace_flexible": False}


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    kind: str  # one of KINDS
    spec: str = ""  # the schema, regex or grammar text; "" for json_object and choice
    choices: tuple[str, ...] = ()  # choice only

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind not in KINDS:
            raise ValueError(f"structured_output kind {self.kind!r} is not one of "
                             f"{', '.join(KINDS)}")
        if self.kind in ("json_schema", "regex", "grammar") and not self.spec:
            raise ValueError(f"structured_output.{self.kind} is empty")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_output.{self.kind} has {len(self.spec)} characters; "
                             f"at most {MAX_SPEC_CHARS}")
        if self.kind == "choice":
            if not self.choices:
                raise ValueError("structured_output.choice needs at least one string")
            if len(self.choices) > MAX_CHOICES:
                raise ValueError(f"structured_output.choice has {len(self.choices)} strings; "
                                 f"at most {MAX_CHOICES}")
            if any(not c for c in self.choices):
                raise ValueError("structured_output.choice has an empty string")
            if sum(map(len, self.choices)) > MAX_SPEC_CHARS:
                raise ValueError("structured_output.choice strings have more than "
                                 f"{MAX_SPEC_CHARS} characters together")

    def grammar_text(self) -> str:
        """llguidance's grammar for this spec (not yet checked: see `grammar_error`)."""
        from llguidance import LLMatcher

        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.spec, defaults=_JSON_DEFAULTS)
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"},
                                                      defaults=_JSON_DEFAULTS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "grammar":
            return LLMatcher.grammar_from_lark(self.spec)
        # Lark string literals take JSON's escapes, so json.dumps quotes any string exactly.
        alternatives = " | ".join(json.dumps(choice) for choice in self.choices)
        return LLMatcher.grammar_from_lark(f"start: {alternatives}")


@functools.lru_cache(maxsize=256)
def grammar_error(structured: StructuredOutput) -> str | None:
    """Why the spec cannot be compiled ("structured_output.<kind>: ..."), or None when it can.
    Checks the grammar without a tokenizer: what a worker compiles for its model then only
    fails on resource limits. Takes up to a second for a large schema: call it off the event
    loop. Answers are cached by spec."""
    from llguidance import LLMatcher

    if structured.kind == "json_schema":
        try:
            json.loads(structured.spec)
        except json.JSONDecodeError as exc:
            return f"structured_output.json_schema is not valid JSON: {exc}"
    try:
        message = LLMatcher.validate_grammar(structured.grammar_text())
    except (ValueError, RuntimeError) as exc:
        message = str(exc)
    if message:
        return f"structured_output.{structured.kind}: {message.strip()}"
    return None
