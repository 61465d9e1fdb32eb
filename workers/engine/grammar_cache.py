"""Compiles structured-output specs into llguidance matchers, off the engine thread, cached.

    compiler = GrammarCompiler(model_path, vocab_size, eos_token_ids)
    future = compiler.compile(spec)      # concurrent.futures.Future[LLMatcher]; never blocks
    matcher = future.result().deep_copy()  # one per request; the cached one stays pristine

Compiling (the model's tokenizer the first time, then the grammar's parser) runs on a small
thread pool; llguidance drops the GIL while it builds, so the engine thread keeps stepping.
Compiled matchers are cached by their grammar text (least recently used dropped past
`max_cached`), so every request with the same schema after the first starts at once. A spec
that does not compile gives a future whose exception is a ValueError naming the problem.
Thread-safe: the worker's event loop and the engine thread both call `compile`.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from tandem.common.logging import get_logger
from tandem.common.structured_output import StructuredOutput

logger = get_logger(__name__)
DEFAULT_MAX_CACHED = 256
DEFAULT_NUM_THREADS = 2
# Runs of JSON string characters, at most n long. llguidance computes a mask by walking the
# vocabulary's token trie, except for "slices": token subsets it takes whole when the lexer's
# state allows every string a slice matches. Its general slices cover runs of up to 10 and 30
# characters; these shorter ones also cover a string with only a few characters left before
# its maxLength, which otherwise walks the whole trie. The masks are the same either way.
SHORT_STRING_SLICES = tuple(r'[^"\\\x00-\x1F\x7F]{1,%d}' % n for n in (2, 4, 6, 8))


class GrammarCompiler:
    def __init__(self, model_path: str | Path, vocab_size: int, eos_token_ids: Iterable[int],
                 *, num_threads: int = DEFAULT_NUM_THREADS,
                 max_cached: int = DEFAULT_MAX_CACHED) -> None:
        self.model_path = Path(model_path)
        self.vocab_size = vocab_size  # the model's: masks cover every logit
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids)
        self.max_cached = max_cached
        self.num_compiles = 0  # grammars compiled (cache misses), failures included
        self.num_cache_hits = 0
        # Called on a pool thread with the seconds each compile took (metrics).
        self.on_compiled: list[Callable[[float], None]] = []
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future] = OrderedDict()  # grammar text -> matcher
        self._tokenizer: Future | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._num_threads = num_threads

    def compile(self, structured: StructuredOutput) -> Future:
        """A future of the spec's pristine matcher (never consume tokens with it: deep_copy).
        A cached future (done or still compiling) is shared."""
        try:
            grammar = structured.grammar_text()
        except (ValueError, RuntimeError) as exc:
            failed: Future = Future()
            failed.set_exception(ValueError(f"structured_output.{structured.kind}: {exc}"))
            return failed
        with self._lock:
            future = self._cache.get(grammar)
            if future is not None:
                self._cache.move_to_end(grammar)
                self.num_cache_hits += 1
                return future
            self.num_compiles += 1
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._num_threads,
                                                thread_name_prefix="grammar")
                self._tokenizer = self._pool.submit(self._load_tokenizer)
            future = self._pool.submit(self._compile, structured.kind, grammar)
            self._cache[grammar] = future
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return future

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, kind: str, grammar: str):
        from llguidance import LLMatcher

        started = time.monotonic()
        try:
            tokenizer = self._tokenizer.result()
            matcher = LLMatcher(tokenizer, grammar, log_level=0)
            if matcher.is_error():
                raise ValueError(f"structured_output.{kind}: {matcher.get_error().strip()}")
            return matcher
        finally:
            seconds = time.monotonic() - started
            for observer in self.on_compiled:
                try:
                    observer(seconds)
                except Exception:  # metrics must never fail a compile
                    logger.exception("grammar compile observer failed")

    def _load_tokenizer(self):
        """The model folder's tokenizer as llguidance needs it, its EOS ids the model's."""
        import llguidance.hf
        from transformers import AutoTokenizer

        try:
            hf_tokenizer = AutoTokenizer.from_pretrained(str(self.model_path),
                                                         local_files_only=True)
        except Exception as exc:
            raise ValueError(f"structured output needs the model's tokenizer; cannot load it "
                             f"from {self.model_path}: {exc}") from exc
        if len(hf_tokenizer) > self.vocab_size:
            raise ValueError(f"structured output: the tokenizer in {self.model_path} has "
                             f"{len(hf_tokenizer)} tokens, more than the model's vocab_size "
                             f"{self.vocab_size}")
        slices = llguidance.LLTokenizer.general_slices() + list(SHORT_STRING_SLICES)
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=self.vocab_size,
                                            eos_token=self.eos_token_ids or None, slices=slices)
