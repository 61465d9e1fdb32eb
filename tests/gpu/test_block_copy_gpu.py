"""The one-pass KV block gather (workers/ops/gpu/block_copy.py) against torch indexing, bit for
bit: stacked caches (one launch for every layer), views with storage offsets, unaligned block
sizes, cache tensors of different widths copied tensor by tensor (cuda_ipc.BlockCopier), and
concurrent copies coalesced into one launch (kv/ipc_copies.py)."""
from __future__ import annotations

import pytest
import torch

from tandem.workers.kv import cuda_ipc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def random_bits(shape, dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device="cuda")
    t.view(torch.uint8).random_(0, 256)  # NaN and inf patterns included
    return t


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype,block", [
    (torch.bfloat16, (16, 8, 128)),   # Llama-8B block: 32 KiB, two chunks
    (torch.float32, (4, 2, 3)),       # 96 B: not a multiple of 16, unaligned blocks
    (torch.float16, (1, 1, 576)),     # an MLA latent row
])
def test_stacked_gather_copies_every_layer_bit_exactly(dtype, block):
    from tandem.workers.ops.gpu.block_copy import BlockGather

    layers, src_blocks, dst_blocks = 6, 23, 19
    src_stack = random_bits((layers, src_blocks, *block), dtype)
    dst_stack = random_bits((layers + 1, dst_blocks, *block), dtype)[1:]  # storage offset
    before = dst_stack.clone()
    src_ids = [22, 0, 7, 7, 13]  # a source block may be read twice
    dst_ids = [3, 18, 0, 9, 11]
    ids = torch.tensor([src_ids, dst_ids], dtype=torch.int32, device="cuda")
    BlockGather(src_stack, dst_stack)(ids)
    torch.cuda.synchronize()
    expected = before.clone()
    expected[:, dst_ids] = src_stack[:, src_ids]
    assert same_bytes(dst_stack, expected)  # copied blocks right, every other block untouched


def test_copier_per_tensor_for_mixed_widths_and_empty_handles():
    # Sparse MLA: a latent and an index-key cache per layer, which no stacked view joins.
    shapes = [(10, 4, 1, 576), (10, 4, 1, 128)] * 3
    src = [random_bits(s, torch.bfloat16) for s in shapes]
    dst = [random_bits(s, torch.bfloat16) for s in shapes]
    copier = cuda_ipc.BlockCopier(src, dst)
    assert not copier.one_launch
    before = [d.clone() for d in dst]
    assert copier.copy([1, 9, 4], [0, 2, 8]) == 3 * sum(d[0].numel() * 2 for d in dst)
    for s, d, b in zip(src, dst, before):
        b[[0, 2, 8]] = s[[1, 9, 4]]
        assert same_bytes(d, b)
    assert copier.copy([], []) == 0
    with pytest.raises(ValueError, match="3 source blocks for 2"):
        copier.launch([1, 2, 3], [0, 1])


def test_concurrent_copies_coalesce_and_land_bit_exactly():
    import asyncio

    from tandem.workers.kv.ipc_copies import CoalescedCopies

    stack = random_bits((8, 40, 16, 2, 64), torch.bfloat16)
    src, dst = list(random_bits((8, 40, 16, 2, 64), torch.bfloat16)), list(stack)
    copier = cuda_ipc.BlockCopier(src, dst)
    assert copier.one_launch
    jobs = [([3, 7], [0, 1]), ([39], [20]), ([5, 6, 7], [30, 31, 32])]
    before = stack.clone()
    launches = []
    launch = copier.launch
    copier.launch = lambda *a: launches.append(a) or launch(*a)  # count, then the real launch

    async def run():
        copies = CoalescedCopies(torch.cuda.Stream())
        await asyncio.gather(*(copies.copy(copier, s, d) for s, d in jobs))

    asyncio.run(run())
    assert len(launches) == 1  # one gather for the three handles
    for s_ids, d_ids in jobs:
        before[:, d_ids] = torch.stack(src)[:, s_ids]
    assert same_bytes(stack, before)


def test_gather_refuses_mismatched_caches():
    from tandem.workers.ops.gpu.block_copy import BlockGather

    ids = torch.zeros((2, 1), dtype=torch.int32, device="cuda")
    a = random_bits((2, 4, 8), torch.float16)
    with pytest.raises(ValueError, match="differ beyond the block count"):
        BlockGather(a, random_bits((2, 4, 16), torch.float16))(ids)
    with pytest.raises(ValueError, match="dtypes differ"):
        BlockGather(a, random_bits((2, 4, 8), torch.bfloat16))(ids)
