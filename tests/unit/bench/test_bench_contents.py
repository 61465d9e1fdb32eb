"""tandem.bench ships what users run: the `tandem bench` load generator and the benchmarks the
README documents. One-off probes and tuning sweeps live in bench/probes/, outside the
installed package, and still import from the repository root."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]


def runnable_modules(folder: Path) -> set[str]:
    """Modules in `folder` with an `if __name__ == "__main__":` block."""
    found = set()
    for path in folder.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                found.add(path.stem)
    return found


def test_every_runnable_bench_module_is_documented_in_the_readme():
    documented = set(re.findall(r"python -m tandem\.bench\.(\w+)",
                                (REPO_ROOT / "README.md").read_text()))
    runnable = runnable_modules(REPO_ROOT / "bench")
    assert runnable, "no runnable module in bench/: the test lost its subject"
    assert runnable - documented == set(), (
        f"tandem.bench ships undocumented entry points {sorted(runnable - documented)}: "
        "document them in the README or move them to bench/probes/")
    assert documented - runnable == set(), f"README runs missing modules {documented - runnable}"


def test_probes_are_not_packaged():
    import tomllib
    table = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert not any(p.startswith("tandem.bench.") for p in table["packages"])
    assert not (REPO_ROOT / "bench" / "probes" / "__init__.py").exists(), \
        "bench/probes/ holds scripts, not a package"
    assert not list((REPO_ROOT / "bench").glob("*.cu")), "CUDA probes belong in bench/probes/"


@pytest.mark.parametrize("name", sorted(runnable_modules(REPO_ROOT / "bench" / "probes")))
def test_probe_imports_resolve(name):
    """Every `tandem.*` module a probe imports exists (the probes themselves
    need a GPU, so only their imports are checked, without running them)."""
    tree = ast.parse((REPO_ROOT / "bench" / "probes" / f"{name}.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and (
                node.module.startswith("tandem")):
            module = importlib.util.find_spec(node.module)
            assert module is not None, f"{name} imports missing module {node.module}"


def test_results_are_one_page_and_logs_are_not_tracked():
    import subprocess
    tracked = subprocess.run(["git", "ls-files", "bench"], cwd=REPO_ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    logs = [name for name in tracked if name.endswith((".log", ".json")) or "/results/" in name]
    assert logs == [], f"raw logs belong in the git-ignored bench/logs/: {logs[:5]}"
    page = (REPO_ROOT / "bench" / "RESULTS.md").read_text()
    for benchmark in ("tandem.bench.engine", "tandem.bench.kv_transfer", "tandem.bench.disagg",
                      "tandem.bench.tp_check"):
        assert f"python -m {benchmark}" in page, f"RESULTS.md has no command for {benchmark}"
