"""The Triton compile watch (workers/ops/jit_compiles.py): its hooks called as Triton 3.6
calls them (keyword arguments: key, repr, fn with .name, ...), since no kernel compiles on a
CPU-only machine; installing into the real triton.knobs when triton is importable. The watch
seeing a real compile is tests/gpu/test_jit_compiles_gpu.py."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from tandem.workers.ops.jit_compiles import JitCompileWatch


def _hook_kwargs(name: str, key) -> dict:
    return dict(key=key, repr=f"{name}[num_warps=4](x: *fp32)", fn=SimpleNamespace(name=name),
                compile={}, is_manual_warmup=False, already_compiled=False)


def test_compiles_are_reported_as_startup_then_as_serving(caplog):
    seen = []
    watch = JitCompileWatch(lambda *a: seen.append(a))
    with caplog.at_level(logging.INFO, logger="tandem.workers.ops.jit_compiles"):
        assert watch.before_compile(**_hook_kwargs("rope_kernel", ("a", 1))) is None
        watch.after_compile(**_hook_kwargs("rope_kernel", ("a", 1)))
        watch.mark_serving()
        watch.before_compile(**_hook_kwargs("attention_kernel", ("b",)))
        watch.after_compile(**_hook_kwargs("attention_kernel", ("b",)))
    assert [(name, serving) for name, _, serving in seen] == [("rope_kernel", False),
                                                               ("attention_kernel", True)]
    assert all(seconds >= 0 for _, seconds, _ in seen) and watch.num_compiles == 2
    levels = {r.getMessage().split()[2]: r.levelno for r in caplog.records}
    assert levels == {"rope_kernel": logging.INFO, "attention_kernel": logging.WARNING}
    assert "while serving" in caplog.records[-1].getMessage()


def test_earlier_hooks_run_first_and_a_skip_is_passed_through(monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    calls = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook",
                        lambda **kw: calls.append(("cache", kw["key"])) or kw["key"] == "skip")
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook",
                        lambda **kw: calls.append(("post", kw["key"])))
    previous = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    seen = []
    watch = JitCompileWatch(lambda *a: seen.append(a))
    assert watch.install()
    assert knobs.runtime.jit_cache_hook == watch.before_compile
    # An earlier hook that returns True skips the compile: Triton must still see True.
    assert knobs.runtime.jit_cache_hook(**_hook_kwargs("k", "skip")) is True
    assert knobs.runtime.jit_cache_hook(**_hook_kwargs("k", "run")) is False
    knobs.runtime.jit_post_compile_hook(**_hook_kwargs("k", "run"))
    assert calls == [("cache", "skip"), ("cache", "run"), ("post", "run")]
    assert [name for name, _, _ in seen] == ["k"]
    watch.uninstall()
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == previous


def test_a_failing_callback_never_breaks_the_compile(caplog):
    def broken(*_):
        raise RuntimeError("metrics backend down")
    watch = JitCompileWatch(broken)
    with caplog.at_level(logging.ERROR, logger="tandem.workers.ops.jit_compiles"):
        watch.before_compile(**_hook_kwargs("k", 1))
        assert watch.after_compile(**_hook_kwargs("k", 1)) is None
    assert any("could not record a compile" in r.getMessage() for r in caplog.records)


def test_install_without_triton_knobs_is_a_no_op(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_triton(name, *args, **kwargs):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("no triton here")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_triton)
    watch = JitCompileWatch()
    assert watch.install() is False
    watch.uninstall()  # nothing to restore
