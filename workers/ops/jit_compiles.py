"""Every Triton JIT compile in a worker, logged with its duration; once the worker serves, as a
warning, because a request waited for it (a new shape or constexpr set met for the first time:
~0.3-2 s on an H100, the whole engine step stalls meanwhile).

    watch = JitCompileWatch(on_compile)     # on_compile(kernel_name, seconds, serving)
    watch.install()                         # at worker start; False without triton.knobs
    watch.mark_serving()                    # once the worker takes requests

Hooks: Triton (3.6's `triton.knobs.runtime`) calls `jit_cache_hook` before compiling a kernel
variant it has not in memory (a truthy return would skip the compile: ours returns whatever a
hook installed before it returned) and `jit_post_compile_hook` after. Hooks installed earlier
keep being called first. A failure inside ours is logged and swallowed: watching must never
break a compile.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from tandem.common.logging import get_logger

logger = get_logger(__name__)
OnCompile = Callable[[str, float, bool], object]


class JitCompileWatch:
    def __init__(self, on_compile: OnCompile | None = None) -> None:
        self._on_compile = on_compile
        self._started: dict[tuple[str, str], float] = {}  # (kernel, variant key) -> start
        self._lock = threading.Lock()  # compiles may run on the engine and the loop thread
        self._serving = False
        self._previous: tuple | None = None  # the hooks found at install, called first
        self.num_compiles = 0

    def install(self) -> bool:
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = knobs.runtime
        if not (hasattr(runtime, "jit_cache_hook") and hasattr(runtime, "jit_post_compile_hook")):
            return False
        self._previous = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook = self.before_compile
        runtime.jit_post_compile_hook = self.after_compile
        return True

    def uninstall(self) -> None:
        if self._previous is not None:
            from triton import knobs

            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._previous
            self._previous = None

    def mark_serving(self) -> None:
        self._serving = True

    def before_compile(self, **kwargs):
        previous = self._previous[0] if self._previous else None
        result = previous(**kwargs) if previous is not None else None
        try:
            if not result:
                with self._lock:
                    self._started[_identity(kwargs)] = time.monotonic()
        except Exception:  # never break a compile
            logger.exception("JIT compile watch: could not record a compile start")
        return result

    def after_compile(self, **kwargs):
        previous = self._previous[1] if self._previous else None
        result = previous(**kwargs) if previous is not None else None
        try:
            kernel, key = _identity(kwargs)
            with self._lock:
                started = self._started.pop((kernel, key), None)
                self.num_compiles += 1
            seconds = time.monotonic() - started if started is not None else 0.0
            if self._serving:  # the variant key names what the warm-up missed
                logger.warning("Triton compiled %s while serving: %.2f s (the engine step "
                               "waited; a warm-up run at startup would move it there); "
                               "variant %s", kernel, seconds, key[:KEY_CHARS])
            else:
                logger.info("Triton compiled %s in %.2f s", kernel, seconds)
                logger.debug("variant of %s: %s", kernel, key[:KEY_CHARS])
            if self._on_compile is not None:
                self._on_compile(kernel, seconds, self._serving)
        except Exception:  # never break a compile
            logger.exception("JIT compile watch: could not record a compile")
        return result


KEY_CHARS = 1500  # of a variant key in the log: Triton's argument specialization and options


def _identity(kwargs) -> tuple[str, str]:
    """The compiled kernel's name and its variant key (Triton's in-memory cache key)."""
    fn = kwargs.get("fn")
    name = getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[", 1)[0]
    return name, str(kwargs.get("key"))
