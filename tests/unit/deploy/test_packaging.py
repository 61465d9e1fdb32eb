"""pyproject.toml's package list covers the source tree: every folder with an __init__.py under
the folders it maps (tandem.workers = workers/, ...) is a listed package, and every non-Python
file the code reads at run time is package data, so a non-editable install (a wheel, a
container image built from one) holds what an editable one does."""
from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

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
