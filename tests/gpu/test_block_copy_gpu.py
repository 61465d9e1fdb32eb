"""The one-pass KV block gather (workers/ops/gpu/block_copy.py) against torch indexing, bit for
bit: stacked caches (one launch for every layer), views with storage offsets, unaligned block
sizes, cache tensors of different widths copied tensor by tensor (cuda_ipc.BlockCopier),
concurrent copies coalesced into one launch (kv/ipc_copies.py), the direct launch of the
compiled kernel after the first one, and pinned id buffers reused under back-to-back copies."""
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


@pytest.mark.parametrize("dtype,block", [(torch.bfloat16, (16, 8, 128)), (torch.float32, (4, 2, 3))])
def test_direct_launches_are_bit_exact_for_every_pair_count(dtype, block):
    """The first launch goes through Triton's binder; every later one calls the compiled kernel
    directly. Pair counts Triton would specialize on (1, multiples of 16) come after others,
    so a wrongly reused variant would copy the wrong number of blocks."""
    from tandem.workers.ops.gpu.block_copy import BlockGather

    layers, num_blocks = 3, 300
    src = random_bits((layers, num_blocks, *block), dtype)
    dst = random_bits((layers, num_blocks, *block), dtype)
    gather = BlockGather(src, dst)
    generator = torch.Generator().manual_seed(1)
    for launch, n in enumerate([5, 1, 16, 17, 2, 64, 1, 255, 33, 300]):
        src_ids = torch.randint(0, num_blocks, (n,), generator=generator).tolist()
        dst_ids = torch.randperm(num_blocks, generator=generator)[:n].tolist()
        ids = torch.tensor([src_ids, dst_ids], dtype=torch.int32)
        ids = ids.pin_memory() if launch % 2 else ids.cuda()  # host-pinned and device ids
        expected = dst.clone()
        expected[:, dst_ids] = src[:, src_ids]
        gather(ids, torch.cuda.current_stream())
        torch.cuda.synchronize()
        assert same_bytes(dst, expected), f"launch {launch}: {n} pairs"
        assert gather.direct_launches == launch  # all but the first were direct


def test_launch_hooks_take_the_plain_path():
    from triton import knobs

    from tandem.workers.ops.gpu.block_copy import BlockGather

    src, dst = random_bits((2, 8, 64), torch.float16), random_bits((2, 8, 64), torch.float16)
    gather = BlockGather(src, dst)
    ids = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32, device="cuda")
    gather(ids)
    launches = []
    hook = knobs.runtime.launch_enter_hook
    hook.add(launches.append)  # Triton 3.6: a HookChain, as a profiler installs it
    try:
        gather(ids)
    finally:
        hook.remove(launches.append)
    torch.cuda.synchronize()
    assert gather.direct_launches == 0 and len(launches) == 1
    gather(ids)
    assert gather.direct_launches == 1


def test_back_to_back_copies_never_reuse_an_id_buffer_still_being_read():
    """Launches queue behind a sleeping kernel, so every id buffer is still unread when the next
    copy fills one: reusing any of them early would send a queued kernel to other blocks."""
    stack = random_bits((4, 256, 16, 64), torch.bfloat16)
    src, dst = list(random_bits((4, 256, 16, 64), torch.bfloat16)), list(stack)
    copier = cuda_ipc.BlockCopier(src, dst)
    expected = stack.clone()
    stream = torch.cuda.Stream()
    copier.copy([0], [0], stream)  # compile outside the timed window
    expected[:, 0] = torch.stack(src)[:, 0]
    generator = torch.Generator().manual_seed(2)
    order = torch.randperm(255, generator=generator).add(1).tolist()
    events = []
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the copies run
    used = 0
    for n in [1, 3, 64, 2, 65, 7, 1, 40, 70, 2]:
        src_ids = torch.randint(0, 256, (n,), generator=generator).tolist()
        dst_ids = order[used:used + n]
        used += n
        events.append(copier.launch(src_ids, dst_ids, stream))
        expected[:, dst_ids] = torch.stack(src)[:, src_ids]
    assert not events[0].query(), "the copies ran before the test could queue them all"
    # the warm-up copy's buffer (completed) is reused once, then none while its kernel waits
    assert copier.ids.allocated == 10
    torch.cuda.synchronize()
    assert same_bytes(stack, expected)
    allocated = copier.ids.allocated
    for _ in range(5):  # completed: the buffers come back
        copier.copy([5, 6], [7, 8], stream)
    assert copier.ids.allocated == allocated


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_stream_of_another_device_gets_a_correct_launch():
    from tandem.workers.ops.gpu.block_copy import BlockGather

    with torch.cuda.device(1):
        src = random_bits((2, 8, 64), torch.float16)
        dst = random_bits((2, 8, 64), torch.float16)
        ids = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32, device="cuda:1")
        stream = torch.cuda.Stream()
    gather = BlockGather(src, dst)
    expected = dst.clone()
    expected[:, [3, 4]] = src[:, [1, 2]]
    with torch.cuda.device(0):
        gather(ids, stream)  # plain launch on cuda:1 (compiled there)
        gather(ids, stream)  # current device 0: not the direct path
    torch.cuda.synchronize(1)
    assert same_bytes(dst, expected) and gather.direct_launches == 0


def test_gather_refuses_mismatched_caches():
    from tandem.workers.ops.gpu.block_copy import BlockGather

    ids = torch.zeros((2, 1), dtype=torch.int32, device="cuda")
    a = random_bits((2, 4, 8), torch.float16)
    with pytest.raises(ValueError, match="differ beyond the block count"):
        BlockGather(a, random_bits((2, 4, 16), torch.float16))(ids)
    with pytest.raises(ValueError, match="dtypes differ"):
        BlockGather(a, random_bits((2, 4, 8), torch.bfloat16))(ids)


@pytest.mark.parametrize("dtype,block", [(torch.bfloat16, (16, 8, 128)), (torch.float32, (4, 2, 3))])
def test_precompile_compiles_the_variant_a_launch_uses(dtype, block):
    """precompile's variant key is the launch's: once either ran for a geometry (here the
    launch), a second gather's precompile and launch compile nothing (the compile watch sees
    every specialization a JIT function makes in this process)."""
    pytest.importorskip("triton")
    from tandem.workers.ops.gpu.block_copy import BlockGather
    from tandem.workers.ops.jit_compiles import JitCompileWatch

    seen = []
    watch = JitCompileWatch(lambda *a: seen.append(a))
    assert watch.install()
    try:
        first = BlockGather(random_bits((3, 9, *block), dtype), random_bits((3, 7, *block), dtype))
        first(torch.tensor([[8], [6]], dtype=torch.int32, device="cuda"))
        compiled = len(seen)
        src, dst = random_bits((3, 5, *block), dtype), random_bits((3, 6, *block), dtype)
        second = BlockGather(src, dst)
        second.precompile()
        assert len(seen) == compiled, seen[compiled:]
        second(torch.tensor([[4, 0], [1, 5]], dtype=torch.int32, device="cuda"))
        torch.cuda.synchronize()
        assert len(seen) == compiled, seen[compiled:]
    finally:
        watch.uninstall()
    assert same_bytes(dst[:, [1, 5]], src[:, [4, 0]])
