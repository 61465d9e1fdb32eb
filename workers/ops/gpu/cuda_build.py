"""Build a CUDA C++ kernel file of ours (workers/ops/gpu/cuda/) into a shared library, once.

The library lands in KernelOptions.kernel_cache_dir ($TANDEM_KERNEL_CACHE, default
~/.cache/tandem/kernels; ops/kernel_options.py) under a name that hashes the source, every
header beside it and the nvcc version, so an edit or a new toolkit rebuilds and concurrent
workers never load a half-written file (atomic rename). Kernels are
called through ctypes on torch's current stream, so CUDA graphs capture them like any launch.
Nothing here is required to serve: without nvcc the callers keep the Triton kernels.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

from tandem.common.logging import get_logger
from tandem.workers.ops import kernel_options

logger = get_logger(__name__)

CUDA_DIR = Path(__file__).parent / "cuda"


def _cache_dir() -> Path:
    return kernel_options.current().kernel_cache_dir


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def build_library(name: str) -> ctypes.CDLL | str:
    """cuda/<name>.cu for sm_90 as a loaded library, or a sentence saying why there is none."""
    nvcc = _nvcc()
    if nvcc is None:
        return "no nvcc on PATH or under CUDA_HOME"
    source = CUDA_DIR / f"{name}.cu"
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(source.read_bytes() + version.encode())
    for header in sorted(CUDA_DIR.glob("*.cuh")):
        digest.update(header.read_bytes())
    target = _cache_dir() / f"{name}-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        command = [nvcc, "-O3", "-use_fast_math", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
                   "-gencode=arch=compute_90,code=sm_90",
                   "-gencode=arch=compute_90,code=compute_90",
                   "-o", str(partial), str(source)]
        logger.info("building %s with %s (once per version, ~20-60 s) into %s", source.name,
                    nvcc, target)
        started = time.monotonic()
        built = subprocess.run(command, capture_output=True, text=True)
        if built.returncode != 0:
            return f"nvcc failed on {source.name}: {built.stderr.strip()[-2000:]}"
        os.replace(partial, target)  # atomic: concurrent workers never load a partial file
        logger.info("built %s in %.1f s", target.name, time.monotonic() - started)
    return ctypes.CDLL(str(target))
