"""Tests of the GPU kernels run on CPU by Triton's interpreter.

They import the kernels, and Triton reads TRITON_INTERPRET when a kernel is decorated, so they
only make sense in a process started with TRITON_INTERPRET=1:
tests/unit/ops/test_triton_interpreter.py starts one. Anywhere else this folder collects
nothing.
"""
from __future__ import annotations

import os

if os.environ.get("TRITON_INTERPRET") != "1":
    collect_ignore_glob = ["test_*.py"]
