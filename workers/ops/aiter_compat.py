"""Load AITER's Triton kernels (`aiter.ops.triton.*`) on NVIDIA as well as AMD GPUs.

Nothing happens at import: the package `amd-aiter` (a pure-Python wheel; `pip install
amd-aiter`) is looked for and patched only when `load_aiter_triton()` is first called, and
later calls return the same object.

What loading does (it is what makes the kernels run on CUDA):
1. `aiter/__init__.py` imports AITER's ROCm JIT, so it is not run: a bare package module named
   `aiter` whose `__path__` is the installed folder goes into `sys.modules`, and only the Triton
   submodules are imported through it. (If `aiter` is already imported, that module is used.)
2. On CUDA only (`torch.version.hip` is None):
   - `aiter.ops.triton.utils._triton.arch_info.get_arch` returns "gfx950" (Triton reports an
     int arch on CUDA, AITER compares gfx strings; gfx950 also picks the OCP fp8 types NVIDIA
     uses);
   - `get_num_xcds` returns 1 (AITER hard-codes MI300's 8 dies and reorders program ids for
     them; with 1 the reordering is the identity);
   - Triton launches drop the AMD-only options `waves_per_eu`, `matrix_instr_nonkdim` and
     `kpack`, which the CUDA backend rejects. This wraps `triton.runtime.jit.JITFunction.run`
     once for the whole process; it only removes those three keywords.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable

INSTALL_HINT = "pip install amd-aiter"
AMD_ONLY_LAUNCH_OPTIONS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")
FAKE_ARCH_ON_CUDA = "gfx950"


class AiterUnavailableError(ImportError):
    """amd-aiter (or what its Triton kernels need: torch with a GPU build, triton) is missing."""


@dataclass(frozen=True)
class AiterTriton:
    """The AITER Triton entry points Tandem uses, loaded and patched for this device."""

    fused_moe: Callable[..., None]  # aiter.ops.triton.moe_op.fused_moe
    moe_op: types.ModuleType  # aiter.ops.triton.moe_op
    unified_attention: Callable[..., None]  # aiter.ops.triton.unified_attention (paged, varlen)
    tl: types.ModuleType  # triton.language (fused_moe takes a tl dtype as compute_type)
    on_cuda: bool  # the NVIDIA patches were applied


_lock = threading.Lock()
_loaded: AiterTriton | None = None


def _find_aiter_dir() -> list[str] | None:
    """The folder(s) of the installed `aiter` package, without importing it; None if absent."""
    module = sys.modules.get("aiter")
    if module is not None and getattr(module, "__path__", None):
        return list(module.__path__)
    try:
        spec = importlib.util.find_spec("aiter")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)


def aiter_available() -> bool:
    """Whether amd-aiter is installed (imports nothing; says nothing about a GPU)."""
    return _find_aiter_dir() is not None


def _register_bare_aiter_package(path: list[str]) -> None:
    if "aiter" in sys.modules:
        return
    pkg = types.ModuleType("aiter")
    pkg.__path__ = path
    pkg.__package__ = "aiter"
    pkg.__doc__ = "amd-aiter, Triton kernels only (registered by tandem's aiter_compat)"
    sys.modules["aiter"] = pkg


def _drop_amd_only_launch_options(jit_module: Any) -> None:
    cls = jit_module.JITFunction
    if getattr(cls.run, "_tandem_drops_amd_options", False):
        return
    original = cls.run

    def run(self, *args, **kwargs):
        for name in AMD_ONLY_LAUNCH_OPTIONS:
            kwargs.pop(name, None)
        return original(self, *args, **kwargs)

    run._tandem_drops_amd_options = True  # type: ignore[attr-defined]
    cls.run = run


def _patch_for_cuda() -> None:
    import triton.runtime.jit as jit_module

    arch_info = importlib.import_module("aiter.ops.triton.utils._triton.arch_info")
    arch_info.get_arch = lambda: FAKE_ARCH_ON_CUDA
    device_info = importlib.import_module("aiter.ops.triton.utils.device_info")
    device_info.get_num_xcds = lambda: 1
    _drop_amd_only_launch_options(jit_module)


def load_aiter_triton() -> AiterTriton:
    """Import (once) and return AITER's Triton kernels, patched to run on this GPU vendor.

    Raises AiterUnavailableError (an ImportError) naming `pip install amd-aiter` when the
    package, triton, or a GPU build of torch is missing.
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        path = _find_aiter_dir()
        if path is None:
            raise AiterUnavailableError(
                f"AITER's Triton kernels need the amd-aiter package, which is not installed: "
                f"{INSTALL_HINT} (or install tandem[gpu])")
        try:
            import torch
            import triton
            import triton.language as tl
        except ImportError as e:
            raise AiterUnavailableError(
                f"AITER's Triton kernels need triton and a GPU build of torch ({e}); "
                f"install them, then {INSTALL_HINT}") from e
        del triton
        on_cuda = torch.version.hip is None
        _register_bare_aiter_package(path)
        try:
            if on_cuda:
                _patch_for_cuda()
            moe_op = importlib.import_module("aiter.ops.triton.moe_op")
            attention = importlib.import_module("aiter.ops.triton.unified_attention")
        except ImportError as e:
            raise AiterUnavailableError(
                f"importing AITER's Triton kernels failed ({type(e).__name__}: {e}); "
                f"this needs {INSTALL_HINT}==0.1.7.post2.dev18 or a compatible version") from e
        if on_cuda:  # moe_op bound get_num_xcds by name at its import
            moe_op.get_num_xcds = lambda: 1
        _loaded = AiterTriton(fused_moe=moe_op.fused_moe, moe_op=moe_op,
                              unified_attention=attention.unified_attention, tl=tl,
                              on_cuda=on_cuda)
        return _loaded
