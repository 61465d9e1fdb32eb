"""The block gather on CPU: (1) what its direct launch relies on, checked against Triton's own
argument binder for an H100 target: one compiled variant serves every launch of a BlockGather
(the pair count and the ids' alignment do not change Triton's specialization) and
launch_args lists the arguments in the binder's order; (2) the kernel under Triton's CPU
interpreter (a subprocess: TRITON_INTERPRET is read when the kernel is decorated) copies bytes
exactly through the plain launch path, which is all the interpreter offers (it returns no
compiled kernel, so BlockGather never launches directly there). The direct launch itself runs
in tests/gpu/test_block_copy_gpu.py."""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")


def test_one_compiled_variant_serves_every_launch_and_launch_args_follow_the_binder():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    from tandem.workers.ops.gpu import block_copy

    kernel = block_copy._gather_blocks_kernel
    binder = create_function_from_signature(kernel.signature, kernel.params,
                                            make_backend(GPUTarget("cuda", 90, 32)))
    gather = block_copy.BlockGather(torch.zeros(3, 9, 4, 16), torch.zeros(5, 7, 4, 16)[1:4])
    variants = set()
    for n, offset in [(1, 0), (5, 1), (16, 0), (17, 3), (64, 2)]:
        ids = torch.zeros(2 * n + offset, dtype=torch.int32)[offset:].view(2, n)
        params, specialization, _ = binder(*gather._jit_args(ids, n), **gather._jit_options)
        variants.add(str(specialization))
        bound = [p.data_ptr() if isinstance(p, torch.Tensor) and p is not ids else p
                 for p in params.values()]
        assert bound == list(gather.launch_args(ids, n))
    assert len(variants) == 1, variants

SCRIPT = r"""
import torch
from tandem.workers.ops.gpu.block_copy import BlockGather

g = torch.Generator().manual_seed(0)
for dtype, block in [(torch.float32, (4, 2, 3)), (torch.bfloat16, (2, 8, 64))]:
    src = torch.randint(0, 256, (3, 9, *block, torch.finfo(dtype).bits // 8), generator=g,
                        dtype=torch.uint8).view(dtype).squeeze(-1)
    dst = torch.zeros((4, 7, *block), dtype=dtype)[1:]  # a storage offset
    gather = BlockGather(src, dst)
    for src_ids, dst_ids in [([8, 0, 0], [6, 1, 2]), ([3], [0])]:  # one pair: no variant mixup
        expected = dst.clone()
        expected[:, dst_ids] = src[:, src_ids]
        gather(torch.tensor([src_ids, dst_ids], dtype=torch.int32))
        same = torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))
        print(dtype, len(src_ids), same, gather.direct_launches)
"""


def test_gather_copies_bytes_exactly_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines()]
    assert len(rows) == 4
    assert all(same == "True" and direct == "0" for *_, same, direct in rows), out.stdout
