"""The product's code and comments state what it does and why, in the present tense: they cite
no results log, no file outside the repository, no numbered session or attempt and no commit.
Measurements live on bench/RESULTS.md; history lives in git."""
from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PRODUCT_FOLDERS = ("workers", "router", "common", "tandem", "protos")
SUFFIXES = {".py", ".cu", ".cuh", ".proto"}

# Each pattern names one kind of lab-notebook reference.
FORBIDDEN = {
    "a notes file outside the repo": re.compile(r"shared/notes"),
    "the old results folder": re.compile(r"bench/results"),
    "a results log": re.compile(r"(?<![.\w-])[\w*]+-[\w*-]+\.log\b"),
    "a numbered session": re.compile(r"\bsession[ -]?\d+", re.IGNORECASE),
    "a numbered attempt": re.compile(r"\battempt[ #]?\d+", re.IGNORECASE),
    "a sitting's file suffix": re.compile(r"-s\d{1,2}\b"),
    "a commit hash": re.compile(r"\bcommits? [0-9a-f]{7,40}\b"),
}


def product_files() -> list[Path]:
    files = []
    for folder in PRODUCT_FOLDERS:
        for path in (REPO_ROOT / folder).rglob("*"):
            if path.suffix in SUFFIXES and "_pb2" not in path.name:
                files.append(path)
    return files


def test_product_text_cites_no_lab_notes():
    files = product_files()
    assert len(files) > 50, "product files not found: the test lost its subject"
    found = []
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for what, pattern in FORBIDDEN.items():
                if pattern.search(line):
                    found.append(f"{path.relative_to(REPO_ROOT)}:{number}: {what}: "
                                 f"{line.strip()[:80]}")
    assert not found, "\n".join(found)


def test_the_patterns_catch_what_they_name():
    samples = {"a notes file outside the repo": "see shared/notes/aiter-on-cuda.md",
               "the old results folder": "(bench/results/engine-h100.log)",
               "a results log": "(engine-h100-fusions.log)",
               "a numbered session": "session 13 review",
               "a numbered attempt": "attempt 2 was slower",
               "a sitting's file suffix": "tp-decode-h200x2-s8",
               "a commit hash": "tried again (commit 9e9b1ba)"}
    assert samples.keys() == FORBIDDEN.keys()
    for what, text in samples.items():
        assert FORBIDDEN[what].search(text), what
    for clean in ("tl.log(l_i)", "math.log(factor)", "self.log(msg)", "logger.info(...)"):
        assert not any(p.search(clean) for p in FORBIDDEN.values()), clean


CONFLICT_MARKER = re.compile(r"^(<{7} |={7}$|>{7} )", re.MULTILINE)
TEXT_SUFFIXES = {".py", ".md", ".proto", ".yaml", ".yml", ".toml", ".json", ".txt", ".sh", ""}


def test_no_file_keeps_merge_conflict_markers():
    files = [path for path in REPO_ROOT.rglob("*")
             if path.is_file() and path.suffix in TEXT_SUFFIXES
             and not any(part.startswith(".") or part in ("node_modules", "__pycache__")
                         for part in path.relative_to(REPO_ROOT).parts)]
    assert any(path.name == "RESULTS.md" for path in files), "the test lost its subject"
    found = [str(path.relative_to(REPO_ROOT)) for path in files
             if CONFLICT_MARKER.search(path.read_text(errors="replace"))]
    assert not found, f"merge conflict markers left in: {found}"
    assert CONFLICT_MARKER.search("x\n<<<<<<< HEAD\ny\n=======\nz\n>>>>>>> branch\n")
