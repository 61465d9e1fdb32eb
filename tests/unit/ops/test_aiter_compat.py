"""CPU checks of the AITER Triton backend's glue: lazy loading, clear errors without amd-aiter,
the expert alignment, and the fused_moe call sequence against a torch model of the kernel."""
import subprocess
import sys
import types

import pytest
import torch

from tandem.workers.ops import aiter_compat, moe
from tandem.workers.ops.backend import KernelBackend
from tandem.workers.ops.moe import FusedMoE, torch_fused_moe
from tandem.workers.ops.moe_aiter import aiter_triton_fused_moe, align_by_expert


def test_import_is_lazy():
    code = ("import sys; import tandem.workers.ops.aiter_compat, tandem.workers.ops.moe; "
            "print('aiter' in sys.modules, 'triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


@pytest.fixture
def no_aiter(monkeypatch):
    monkeypatch.setattr(aiter_compat, "_find_aiter_dir", lambda: None)
    monkeypatch.setattr(aiter_compat, "_loaded", None)


def test_missing_aiter_names_the_install(no_aiter):
    assert not aiter_compat.aiter_available()
    with pytest.raises(ImportError, match="pip install amd-aiter"):
        aiter_compat.load_aiter_triton()
    with pytest.raises(aiter_compat.AiterUnavailableError):
        aiter_compat.load_aiter_triton()  # still raises; nothing half-loaded is cached


def test_fused_moe_backend_unavailable_is_a_construction_error(no_aiter):
    with pytest.raises(ValueError, match="aiter-triton.*pip install amd-aiter"):
        FusedMoE(4, 16, 8, backend=KernelBackend.AITER_TRITON)


@pytest.mark.parametrize("kwargs, message", [
    (dict(activation="swigluoai"), "activation='silu' only"),
    (dict(bias=True), "biases"),
])
def test_aiter_backend_rejects_what_it_cannot_run(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FusedMoE(4, 16, 8, backend=KernelBackend.AITER_TRITON, **kwargs)


@pytest.mark.parametrize("num_tokens, top_k, num_experts, block_m",
                         [(1, 2, 8, 16), (7, 2, 8, 16), (64, 8, 128, 16), (300, 2, 8, 64),
                          (33, 4, 16, 32)])
def test_align_by_expert(num_tokens, top_k, num_experts, block_m):
    torch.manual_seed(num_tokens)
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)])
    sorted_ids, expert_ids, num_post = align_by_expert(ids, num_experts, block_m)
    n = ids.numel()
    used = int(num_post)
    assert used % block_m == 0 and used <= sorted_ids.numel()
    assert expert_ids.numel() * block_m == sorted_ids.numel()
    assert (sorted_ids[used:] == n).all()
    real = sorted_ids[:used][sorted_ids[:used] < n]
    assert sorted(real.tolist()) == list(range(n))  # every slot exactly once
    flat = ids.reshape(-1)
    for b in range(used // block_m):
        block = sorted_ids[b * block_m:(b + 1) * block_m]
        block = block[block < n].long()
        assert block.numel() > 0
        assert (flat[block] == expert_ids[b]).all()


def _fake_fused_moe(A, B, C, A_scale, B_scale, B_zp, topk_weights, topk_ids, sorted_ids,
                    expert_ids, num_post, mul_routed_weight, top_k, compute_type, *rest):
    """What AITER's fused_moe kernel computes, in torch (bf16 off; fp32 CPU)."""
    block_m = rest[-1]["BLOCK_SIZE_M"]
    n = topk_ids.numel()
    out = C.view(-1, C.shape[-1])
    for b in range(int(num_post) // block_m):
        slots = sorted_ids[b * block_m:(b + 1) * block_m].long()
        slots = slots[slots < n]
        y = A[slots // top_k] @ B[int(expert_ids[b])].t()
        if mul_routed_weight:
            y = y * topk_weights.reshape(-1)[slots, None]
        out[slots] = y.to(out.dtype)


def test_call_sequence_matches_torch_backend(monkeypatch):
    fake = types.SimpleNamespace(fused_moe=_fake_fused_moe,
                                 tl=types.SimpleNamespace(bfloat16="bf16", float16="fp16",
                                                          float32="fp32"))
    monkeypatch.setattr(aiter_compat, "load_aiter_triton", lambda: fake)
    torch.manual_seed(0)
    T, H, I, E, k = 37, 32, 24, 8, 2
    hidden = torch.randn(T, H)
    w13 = torch.randn(E, 2 * I, H) / 4
    w2 = torch.randn(E, H, I) / 4
    weights, ids = moe.select_experts(torch.randn(T, E), k, renormalize=True)
    ref = torch_fused_moe(hidden, w13, w2, weights, ids)
    for config in (None, dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=16, BLOCK_SIZE_K=16,
                              GROUP_SIZE_M=1)):
        out = aiter_triton_fused_moe(hidden, w13, w2, weights, ids, config=config)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("moe_prefill", [True, False])
def test_moe_prefill_option_picks_the_large_batch_kernel(monkeypatch, moe_prefill):
    """On aiter-triton, batches past the decode path run our grouped GEMMs
    (ops/gpu/moe_prefill.py) unless the moe_prefill kernel option is off."""
    from tandem.workers.ops import kernel_options
    from tandem.workers.ops.kernel_options import KernelOptions
    monkeypatch.setattr(aiter_compat, "load_aiter_triton", lambda: None)
    installed = kernel_options.current()
    try:
        kernel_options.install(KernelOptions(moe_prefill=moe_prefill))
        layer = FusedMoE(4, 16, 8, backend=KernelBackend.AITER_TRITON)
        # 12-wide expert rows (24 bytes) are not what the kernels' tensor descriptors take
        unaligned = FusedMoE(4, 16, 12, backend=KernelBackend.AITER_TRITON)
    finally:
        kernel_options.install(installed)
    expected = moe.prefill_kernels_fused_moe if moe_prefill else aiter_triton_fused_moe
    assert layer._fused_moe is expected
    assert unaligned._fused_moe is aiter_triton_fused_moe
    assert FusedMoE(4, 16, 8)._fused_moe is torch_fused_moe  # the torch backend never


def test_kernels_choice_resolves_per_device(monkeypatch, caplog):
    from tandem.workers.ops import backend as backend_mod
    from tandem.workers.ops.backend import KernelBackend, resolve_backend

    assert resolve_backend("auto", "cpu") is KernelBackend.TORCH
    assert resolve_backend("torch", "cuda") is KernelBackend.TORCH
    with pytest.raises(ValueError, match="aiter-triton' needs a GPU; device is 'cpu'"):
        resolve_backend("aiter-triton", "cpu")
    with pytest.raises(ValueError, match="'aiter' is not one of auto, torch, aiter-triton"):
        resolve_backend("aiter", "cuda")
    monkeypatch.setattr(backend_mod, "triton_available", lambda: True)
    monkeypatch.setattr(backend_mod, "aiter_available", lambda: True)
    assert resolve_backend("auto", "cuda") is KernelBackend.AITER_TRITON
    assert resolve_backend("auto", "cpu") is KernelBackend.TORCH
    monkeypatch.setattr(backend_mod, "aiter_available", lambda: False)
    backend_mod._warn_torch_on_gpu.cache_clear()
    with caplog.at_level("WARNING", logger=backend_mod.logger.name):
        for _ in range(3):  # auto falls back, saying once what is missing
            assert resolve_backend("auto", "cuda") is KernelBackend.TORCH
    warnings = [r.getMessage() for r in caplog.records if "torch kernels run" in r.getMessage()]
    assert len(warnings) == 1 and "amd-aiter is not installed" in warnings[0]
    with pytest.raises(ValueError, match="pip install amd-aiter"):
        resolve_backend("aiter-triton", "cuda")  # an explicit choice says what is missing


def test_engine_refuses_gpu_kernels_on_cpu(checkpoint):
    from tandem import LLM

    with pytest.raises(ValueError, match="kernels='aiter-triton' needs a GPU"):
        LLM(checkpoint("llama").path, device="cpu", kernels="aiter-triton")
