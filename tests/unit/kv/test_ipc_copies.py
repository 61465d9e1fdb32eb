"""CoalescedCopies' batching rules on CPU, with a host copier in BlockCopier's shape (launch ->
an event with synchronize()); tests/gpu/test_block_copy_gpu.py runs it with the real
BlockCopier on a GPU."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from tandem.workers.kv.ipc_copies import CoalescedCopies


class HostCopier:
    """Copies rows of one tensor into another; its 'event' completes when `gate` is set."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, fail: str | None = None) -> None:
        self.src, self.dst, self.fail = src, dst, fail
        self.launches: list[tuple[list[int], list[int]]] = []
        self.gate = threading.Event()
        self.gate.set()

    def launch(self, src_ids, dst_ids, stream=None):
        if self.fail:
            raise RuntimeError(self.fail)
        self.launches.append((src_ids, dst_ids))
        copier = self

        class Done:
            def synchronize(self):
                copier.gate.wait()
                copier.dst[dst_ids] = copier.src[src_ids]

        return Done()


def test_one_turns_copies_go_out_as_one_launch_per_copier():
    a = HostCopier(torch.arange(10.0), torch.zeros(10))
    b = HostCopier(torch.arange(10.0) + 100, torch.zeros(10))

    async def run():
        copies = CoalescedCopies(stream=None)
        await asyncio.gather(copies.copy(a, [1, 2], [5, 6]), copies.copy(a, [9], [0]),
                             copies.copy(b, [3], [3]))
        await copies.copy(a, [4], [4])  # a later turn: a launch of its own

    asyncio.run(run())
    assert a.launches == [([1, 2, 9], [5, 6, 0]), ([4], [4])]
    assert b.launches == [([3], [3])]
    assert a.dst.tolist() == [9, 0, 0, 0, 4, 1, 2, 0, 0, 0]
    assert b.dst[3] == 103


def test_a_failed_launch_fails_every_copy_of_its_batch_and_a_bad_request_fails_alone():
    bad = HostCopier(torch.zeros(4), torch.zeros(4), fail="peer unmapped")

    async def run():
        copies = CoalescedCopies(stream=None)
        results = await asyncio.gather(copies.copy(bad, [0], [1]), copies.copy(bad, [2], [3]),
                                       return_exceptions=True)
        assert [str(r) for r in results] == ["peer unmapped"] * 2
        with pytest.raises(ValueError, match="2 source blocks for 1"):
            await copies.copy(bad, [0, 1], [2])

    asyncio.run(run())


def test_a_cancelled_copy_returns_only_after_its_blocks_are_written():
    copier = HostCopier(torch.arange(4.0), torch.zeros(4))
    copier.gate.clear()  # the GPU is still copying

    async def run():
        copies = CoalescedCopies(stream=None)
        task = asyncio.create_task(copies.copy(copier, [1], [2]))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done()  # still holding the blocks
        copier.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert copier.dst[2] == 1

    asyncio.run(run())
