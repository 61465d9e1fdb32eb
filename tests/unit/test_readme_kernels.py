"""The README's `--kernels` table matches the dispatch code: its rows are exactly the choices the
worker accepts (workers/ops/backend.py KERNEL_CHOICES), and the AITER kernels it names are
exactly the AITER entry points the code loads (workers/ops/aiter_compat.py AiterTriton)."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from tandem.workers.ops.aiter_compat import AiterTriton
from tandem.workers.ops.backend import KERNEL_CHOICES, KernelBackend

REPO_ROOT = Path(__file__).resolve().parents[2]


def kernels_table() -> dict[str, str]:
    """The README's `--kernels` table: choice -> what runs."""
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| `--kernels` |"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        choice, what = line.strip("|").split("|", 1)
        rows[re.search(r"`([^`]+)`", choice).group(1)] = what
    return rows


def test_readme_kernels_rows_are_the_accepted_choices():
    assert set(kernels_table()) == set(KERNEL_CHOICES)


def test_every_accepted_choice_resolves_where_its_needs_are_met(monkeypatch):
    """No choice is accepted only to be refused later: with triton and amd-aiter present on a
    GPU, each choice resolves to a backend."""
    from tandem.workers.ops import backend as backend_mod
    monkeypatch.setattr(backend_mod, "triton_available", lambda: True)
    monkeypatch.setattr(backend_mod, "aiter_available", lambda: True)
    for choice in KERNEL_CHOICES:
        assert isinstance(backend_mod.resolve_backend(choice, "cuda"), KernelBackend), choice


def test_readme_names_the_aiter_kernels_the_code_loads():
    row = kernels_table()["aiter-triton"]
    named = set(re.findall(r"AITER `(\w+)`", row))
    loaded = {f.name for f in dataclasses.fields(AiterTriton) if "Callable" in str(f.type)}
    assert loaded, "AiterTriton lists no kernel: the test lost its subject"
    assert named == loaded, f"README names AITER {sorted(named)}, the code loads {sorted(loaded)}"


def test_readme_env_switches_exist_in_the_code():
    row = kernels_table()["aiter-triton"]
    code = "\n".join(p.read_text() for p in (REPO_ROOT / "workers").rglob("*.py"))
    for name in re.findall(r"`(TANDEM_\w+)", row):
        assert f'"{name}"' in code, f"README names {name}, which no worker module reads"


def architecture_text() -> str:
    """The README's Architecture section."""
    readme = (REPO_ROOT / "README.md").read_text()
    start = readme.index("\n## Architecture\n")
    return readme[start:readme.index("\n## ", start + 1)]


def test_architecture_doc_names_the_aiter_kernels_the_code_loads():
    text = architecture_text()
    named = set(re.findall(r"AITER `(\w+)`", text))
    loaded = {f.name for f in dataclasses.fields(AiterTriton) if "Callable" in str(f.type)}
    assert named == loaded, f"the README names AITER {sorted(named)}, the code loads {sorted(loaded)}"
    for choice in KERNEL_CHOICES:
        assert f"`{choice}`" in text or choice == "auto", choice


def test_architecture_doc_cites_modules_that_exist():
    text = architecture_text()
    cited = set(re.findall(r"`?((?:ops|kv|parallel|engine|models)/[\w/]+\.py)", text))
    cited |= set(re.findall(r"`((?:workers|router|bench|tandem)/[\w/]+\.py)`", text))
    assert len(cited) > 10, "the doc cites no modules: the test lost its subject"
    search = [REPO_ROOT, REPO_ROOT / "workers"]
    missing = [c for c in cited if not any((root / c).is_file() for root in search)]
    assert missing == [], f"the Architecture section cites missing modules {missing}"
