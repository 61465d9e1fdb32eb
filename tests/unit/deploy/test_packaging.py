"""pyproject.toml's package list covers the source tree: every folder with an __init__.py under
the folders it maps (tandem.workers = workers/, ...) is a listed package, and every non-Python
file the code reads at run time is package data, so a non-editable install (a wheel, a
container image built from one) holds what an editable one does."""
from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]


def setuptools_table() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def source_folder(package: str, package_dir: dict[str, str]) -> Path:
    """The folder setuptools takes `package` from (the longest mapped prefix wins)."""
    parts = package.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in package_dir:
            return REPO_ROOT / package_dir[prefix] / Path(*parts[cut:])
    return REPO_ROOT / Path(*parts)


def test_every_source_package_is_listed():
    table = setuptools_table()
    package_dir, listed = table["package-dir"], set(table["packages"])
    found = set()
    for top, folder in package_dir.items():
        for init in (REPO_ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(REPO_ROOT / folder)
            found.add(".".join([top, *relative.parts]))
    assert found - listed == set(), f"packages missing from pyproject.toml: {found - listed}"
    for package in listed:
        assert (source_folder(package, package_dir) / "__init__.py").is_file(), package


def test_kernel_sources_are_package_data():
    table = setuptools_table()
    package_dir, data = table["package-dir"], table.get("package-data", {})
    sources = list((REPO_ROOT / "workers").rglob("*.cu"))
    assert sources, "no CUDA sources found: the test lost its subject"
    for source in sources:
        covered = False
        for package, patterns in data.items():
            folder = source_folder(package, package_dir)
            if folder in source.parents:
                relative = source.relative_to(folder).as_posix()
                covered |= any(fnmatch.fnmatch(relative, p) for p in patterns)
        assert covered, f"{source.relative_to(REPO_ROOT)} is not package data"


def test_package_data_sits_in_listed_packages():
    """setuptools warns (40 lines, every install) about data files in a folder that is not
    itself a listed package: every pattern must name files directly in its package."""
    for package, patterns in setuptools_table().get("package-data", {}).items():
        assert package in setuptools_table()["packages"], package
        nested = [pattern for pattern in patterns if "/" in pattern]
        assert not nested, f"{package}: {nested} are in a subfolder; list it as a package"


def test_building_the_package_prints_no_warning(tmp_path):
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:  # pyproject's [build-system] needs 77
        pytest.skip(f"setuptools {setuptools.__version__} < 77 cannot read pyproject.toml")
    source = tmp_path / "src"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True,
                             check=True).stdout.decode().split("\0")
    for name in filter(None, tracked):
        if (REPO_ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / name, source / name)
    built = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q",
                            "build_py", "--build-lib", str(tmp_path / "lib")], cwd=source,
                           capture_output=True, text=True, timeout=120,
                           env={k: v for k, v in os.environ.items()
                                if k != "PYTHONDONTWRITEBYTECODE"})  # its own warning
    assert built.returncode == 0, built.stderr
    assert "warning" not in (built.stdout + built.stderr).lower(), built.stderr[:3000]
    kernels = tmp_path / "lib" / "tandem" / "workers" / "ops" / "gpu" / "cuda"
    assert (kernels / "decode_blocks.cu").is_file() and list(kernels.glob("*.cuh"))
    # The built package ships no probe: bench/probes/ stays in the repository only.
    assert [p.name for p in (tmp_path / "lib").iterdir()] == ["tandem"]
    probes = {p.stem for p in (REPO_ROOT / "bench" / "probes").glob("*.py")}
    shipped = {p.stem for p in (tmp_path / "lib" / "tandem" / "bench").rglob("*.py")}
    assert probes and probes & shipped == set(), f"probes in the package: {probes & shipped}"
