"""Imports run downward only (DESIGN.md, KV transfer): the KV transfer code (workers/kv/) and the
rank-group code (workers/parallel/) import neither the engine, the async engine, the servicers
nor the protobuf stubs (protobuf is converted at the edge, common/convert.py), and the
rank-group code imports no KV transfer and no executor either (the KV transfer of a TP worker
rides the step broadcast as opaque KV rank ops); common/ imports nothing from workers/. The engine steps an executor built before it (workers/executor/) and
imports nothing that starts or drives other ranks. Every import statement counts, those inside
functions too.

The same walk keeps the engine's command seam typed: outside workers/async_engine.py (where the
typed commands live) and workers/kv/ (whose rank transfers post their own engine-thread
callables), no module hands the async engine a function to run (`engine.call(fn)`,
`call_shielded(fn)`, `submit(fn)`); it calls one of AsyncEngine's typed methods instead. The
gRPC services do not reach past the async engine to the LLMEngine (`engine.engine`): they read
its published load."""
from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# package folder -> the modules (and their submodules) it must not import
FORBIDDEN = {
    "workers/kv": ("tandem.workers.engine", "tandem.workers.async_engine",
                   "tandem.workers.servicer", "tandem.v1", "tandem.common.convert"),
    "workers/parallel": ("tandem.workers.engine", "tandem.workers.async_engine",
                         "tandem.workers.servicer", "tandem.v1", "tandem.common.convert",
                         "tandem.workers.kv", "tandem.workers.executor"),
    "common": ("tandem.workers",),
    "workers/engine/engine.py": ("tandem.workers.parallel", "tandem.workers.executor.rank_runner",
                                 "tandem.workers.executor.followers"),
}


# Where handing the async engine a callable is its protocol, not a reach-through.
RAW_ENGINE_CALLERS = ("workers/async_engine.py", "workers/kv")
RAW_ENGINE_COMMANDS = ("call", "call_shielded", "submit")
# The gRPC services: they hold an AsyncEngine and nothing below it.
SERVICE_MODULES = ("workers/servicer.py", "workers/kv_events.py",
                   "workers/kv_transfer_service.py")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a source file; `from a import b` gives a.b too, so a
    module imported by name from its package is seen."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def is_under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def upward_imports(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    root = REPO_ROOT / folder
    paths = root.rglob("*.py") if root.is_dir() else [root]
    return sorted({f"{path.relative_to(REPO_ROOT)}:{line} imports {module}"
                   for path in paths
                   for line, module in imported_modules(path)
                   if any(is_under(module, package) for package in forbidden)})


def _names_an_engine(node: ast.expr) -> bool:
    """`engine`, `self.engine`, `self._engine`, `async_engine`...: the receiver names an engine."""
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
    return "engine" in name.lower()


def raw_engine_calls(path: Path) -> list[tuple[int, str]]:
    """(line, source) of every `<engine>.call/call_shielded/submit(...)` in a source file."""
    source = path.read_text()
    return sorted((node.lineno, ast.get_source_segment(source, node).splitlines()[0])
                  for node in ast.walk(ast.parse(source, str(path)))
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in RAW_ENGINE_COMMANDS
                  and _names_an_engine(node.func.value))


def engine_reach_throughs(folder: str = "workers") -> list[str]:
    allowed = [REPO_ROOT / path for path in RAW_ENGINE_CALLERS]
    return sorted(f"{path.relative_to(REPO_ROOT)}:{line} {text.strip()}"
                  for path in (REPO_ROOT / folder).rglob("*.py")
                  if not any(path == root or root in path.parents for root in allowed)
                  for line, text in raw_engine_calls(path))


def engine_internals_read(path: Path) -> list[tuple[int, str]]:
    """(line, source) of every `<engine>.engine` in a source file: the LLMEngine behind an
    AsyncEngine."""
    source = path.read_text()
    return sorted((node.lineno, ast.get_source_segment(source, node))
                  for node in ast.walk(ast.parse(source, str(path)))
                  if isinstance(node, ast.Attribute) and node.attr == "engine"
                  and _names_an_engine(node.value))


def test_kv_imports_nothing_above_it():
    assert upward_imports("workers/kv", FORBIDDEN["workers/kv"]) == []


def test_parallel_imports_nothing_above_it():
    assert upward_imports("workers/parallel", FORBIDDEN["workers/parallel"]) == []


def test_common_imports_nothing_from_workers():
    assert upward_imports("common", FORBIDDEN["common"]) == []


def test_the_engine_neither_starts_nor_drives_other_ranks():
    engine = "workers/engine/engine.py"
    assert upward_imports(engine, FORBIDDEN[engine]) == []


def test_the_walk_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "lazy.py"
    source.write_text("def f():\n    from tandem.v1 import worker_pb2\n")
    assert (2, "tandem.v1.worker_pb2") in imported_modules(source)


def test_nothing_outside_the_async_engine_hands_the_engine_a_function():
    assert engine_reach_throughs() == []


def test_the_walk_sees_engine_commands_given_a_function(tmp_path):
    source = tmp_path / "reach.py"
    source.write_text("async def f(self, engine, command):\n"
                      "    await self.engine.call(lambda e: e.abort('r'))\n"
                      "    engine.submit(command)\n"
                      "    await self.pool.call(command)\n")
    assert [line for line, _ in raw_engine_calls(source)] == [2, 3]


def test_the_services_read_no_engine_internals():
    assert [f"{module}:{line} {text}" for module in SERVICE_MODULES
            for line, text in engine_internals_read(REPO_ROOT / module)] == []
