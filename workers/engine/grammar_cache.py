"""Compiles structured-output specs into llguidance grammars, off the engine thread, cached.

    compiler = GrammarCompiler(model_path, vocab_size, eos_token_ids)
    future = compiler.compile(spec)   # concurrent.futures.Future[CompiledGrammar]; never blocks
    grammar = future.result()
    matcher = grammar.bind(grammar.register(request))  # one per request (grammar_mask.py)

Compiling (the model's tokenizer the first time, then the grammar's parser) runs on a small
thread pool; llguidance drops the GIL while it builds, so the engine thread keeps stepping.
Compiled grammars are cached by their grammar text (least recently used dropped past
`max_cached`), so every request with the same schema after the first starts at once. A spec
that does not compile gives a future whose exception is a ValueError naming the problem.
Thread-safe: the worker's event loop and the engine thread both call `compile`.

Replicas. An llguidance matcher made by `deep_copy` shares its source's lexer (the lazily
built DFA the mask computation walks the token trie with) behind one mutex, held for the
whole of a mask computation. Matchers copied from one compiled matcher therefore compute
their masks one at a time, however many threads the fill has. A `CompiledGrammar` keeps up to
`max_replicas` independently compiled matchers of its grammar (one lexer each), as many as it
has live requests; each request binds to the replica with the fewest bound matchers, so rows
on different replicas fill in parallel while rows on one replica share its warm DFA.
"""
from __future__ import annotations

import os
import threading
import time
import weakref
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


def default_fill_threads() -> int:
    """Threads of the mask fill, and so replicas a grammar may keep: llguidance's own default
    (80% of the CPUs this process may use, 1 to 32)."""
    return min(max(len(os.sched_getaffinity(0)) * 80 // 100, 1), 32)


class GrammarUse:
    """One request's claim on a compiled grammar: counted while the request lives, and the
    replica its matcher was copied from once it has one."""

    __slots__ = ("replica",)

    def __init__(self) -> None:
        self.replica: int | None = None


class CompiledGrammar:
    """One grammar text's compiled matchers (replicas), never advanced themselves.

    Invariants: `num_replicas` ready replicas plus the compiles in flight never exceed
    max(1, min(max_replicas, live requests)) when a compile is started; the bound counts are
    the live requests whose matcher came from each replica. Thread-safe (the engine thread
    binds; pool threads add replicas; any thread may drop the last reference to a request).
    """

    def __init__(self, first, compile_replica: Callable[[], object],
                 submit: Callable[[Callable[[], None]], bool], max_replicas: int) -> None:
        self.max_replicas = max(1, max_replicas)
        self._compile_replica = compile_replica  # () -> a fresh LLMatcher of this grammar
        self._submit = submit  # runs a callable on a background thread; False: it cannot
        self._lock = threading.Lock()
        self._replicas = [first]
        self._num_bound = [0]  # live matchers copied from each replica
        self._num_users = 0  # live requests of this grammar (bound or not yet)
        self._num_compiling = 0

    @property
    def num_replicas(self) -> int:
        return len(self._replicas)

    @property
    def num_compiling(self) -> int:
        return self._num_compiling

    def register(self, owner) -> GrammarUse:
        """Counts owner (a request's grammar state with a `use` attribute, None until this
        sets it; weak references to it must be allowed) as a user until it is garbage; more
        users than replicas starts another replica's compile. Idempotent per owner."""
        with self._lock:
            use = getattr(owner, "use", None)
            if use is not None:
                return use
            use = owner.use = GrammarUse()
            self._num_users += 1
            self._grow_locked()
        weakref.finalize(owner, self._release, use)
        return use

    def bind(self, use: GrammarUse):
        """A new matcher for a registered request, copied from the replica with the fewest
        bound matchers (it shares that replica's lexer)."""
        with self._lock:
            replica = min(range(len(self._replicas)), key=self._num_bound.__getitem__)
            self._num_bound[replica] += 1
            use.replica = replica
            source = self._replicas[replica]
        return source.deep_copy()

    def rebind(self, use: GrammarUse):
        """A new matcher for use from a replica with at least two fewer bound matchers than
        its own, moving use there (the caller replays the request's tokens into it); None
        when its replica is within one of the lightest."""
        with self._lock:
            lightest = min(range(len(self._replicas)), key=self._num_bound.__getitem__)
            if self._num_bound[use.replica] - self._num_bound[lightest] < 2:
                return None
            self._num_bound[use.replica] -= 1
            self._num_bound[lightest] += 1
            use.replica = lightest
            source = self._replicas[lightest]
        return source.deep_copy()

    def unbound_matcher(self):
        """A matcher of this grammar outside the replica accounting (references, tools)."""
        return self._replicas[0].deep_copy()

    def _release(self, use: GrammarUse) -> None:
        with self._lock:
            self._num_users -= 1
            if use.replica is not None:
                self._num_bound[use.replica] -= 1

    def _grow_locked(self) -> None:
        wanted = min(self.max_replicas, self._num_users)
        while len(self._replicas) + self._num_compiling < wanted:
            self._num_compiling += 1
            if not self._submit(self._add_replica):
                self._num_compiling -= 1
                return

    def _add_replica(self) -> None:
        try:
            replica = self._compile_replica()
        except Exception:  # the first replica compiled: a failure here is not the grammar's
            logger.exception("grammar replica compile failed")
            replica = None
        with self._lock:
            self._num_compiling -= 1
            if replica is not None and not replica.is_error():
                self._replicas.append(replica)
                self._num_bound.append(0)


class GrammarCompiler:
    def __init__(self, model_path: str | Path, vocab_size: int, eos_token_ids: Iterable[int],
                 *, num_threads: int = DEFAULT_NUM_THREADS,
                 max_cached: int = DEFAULT_MAX_CACHED, max_replicas: int | None = None,
                 tokenizer=None) -> None:
        """max_replicas: independently compiled matchers a grammar may keep (default: the
        mask fill's threads, `default_fill_threads`; 1 makes every request of a grammar share
        one lexer). tokenizer: an llguidance LLTokenizer already made for this model (another
        compiler's `tokenizer()`), instead of loading the model folder's."""
        self.model_path = Path(model_path)
        self.vocab_size = vocab_size  # the model's: masks cover every logit
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids)
        self.max_cached = max_cached
        self.num_compiles = 0  # grammars compiled (cache misses), failures included
        self.num_cache_hits = 0
        # Called on a pool thread with the seconds each compile took (metrics).
        self.on_compiled: list[Callable[[float], None]] = []
        self.max_replicas = default_fill_threads() if max_replicas is None else max_replicas
        self._lock = threading.Lock()
        # grammar text -> Future[CompiledGrammar]
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._tokenizer: Future | None = None
        if tokenizer is not None:
            self._tokenizer = Future()
            self._tokenizer.set_result(tokenizer)
        self._pool: ThreadPoolExecutor | None = None
        # Replicas compile on their own thread: they never delay a grammar's first compile.
        self._replica_pool: ThreadPoolExecutor | None = None
        self._num_threads = num_threads

    def compile(self, structured: StructuredOutput) -> Future:
        """A future of the spec's CompiledGrammar. A cached future (done or still compiling)
        is shared."""
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
                self._replica_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-replica")
                if self._tokenizer is None:
                    self._tokenizer = self._pool.submit(self._load_tokenizer)
            future = self._pool.submit(self._compile, structured.kind, grammar)
            self._cache[grammar] = future
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return future

    def tokenizer(self):
        """The llguidance tokenizer every grammar compiles against (loads it if needed)."""
        if self._tokenizer is None:
            with self._lock:
                if self._tokenizer is None:
                    self._tokenizer = Future()
                    self._tokenizer.set_result(self._load_tokenizer())
        return self._tokenizer.result()

    def shutdown(self) -> None:
        for pool in (self._pool, self._replica_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    def _submit_replica(self, work: Callable[[], None]) -> bool:
        try:
            self._replica_pool.submit(work)
            return True
        except RuntimeError:  # shut down: the grammar keeps the replicas it has
            return False

    def _compile(self, kind: str, grammar: str):
        from llguidance import LLMatcher

        started = time.monotonic()
        try:
            tokenizer = self._tokenizer.result()
            matcher = LLMatcher(tokenizer, grammar, log_level=0)
            if matcher.is_error():
                raise ValueError(f"structured_output.{kind}: {matcher.get_error().strip()}")
            return CompiledGrammar(matcher, lambda: LLMatcher(tokenizer, grammar, log_level=0),
                                   self._submit_replica, self.max_replicas)
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
