"""CoalescedCopies' batching rules on CPU, with a host copier in BlockCopier's shape (launch ->
an event with query() and synchronize(), waited by the EventWaiter: polled on the loop, then
on its thread); tests/gpu/test_block_copy_gpu.py runs it with the real BlockCopier on a GPU."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from tandem.workers.kv.event_waiter import EventWaiter
from tandem.workers.kv.ipc_copies import CoalescedCopies


class HostCopier:
    """Copies rows of one tensor into another; its 'event' completes when `gate` is set."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, fail: str | None = None) -> None:
        self.src, self.dst, self.fail = src, dst, fail
        self.launches: list[tuple[list[int], list[int]]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.copy_error: str | None = None  # the 'GPU' fails the copy (synchronize raises)

    def launch(self, src_ids, dst_ids, stream=None):
        if self.fail:
            raise RuntimeError(self.fail)
        self.launches.append((src_ids, dst_ids))
        copier = self

        class Done:  # the 'GPU' copies once the gate is open
            landed = False

            def query(self):
                if not copier.gate.is_set():
                    return False
                self.land()
                return True

            def synchronize(self):
                copier.gate.wait()
                self.land()

            def land(self):
                if copier.copy_error:
                    raise RuntimeError(copier.copy_error)
                if not self.landed:
                    copier.dst[dst_ids] = copier.src[src_ids]
                    self.landed = True

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


def test_a_failed_copy_fails_its_batch_after_the_wait_and_later_copies_still_land():
    copier = HostCopier(torch.arange(6.0), torch.zeros(6))
    copier.copy_error = "an illegal memory access was encountered"
    copier.gate.clear()

    async def run():
        copies = CoalescedCopies(stream=None)
        batch = asyncio.gather(copies.copy(copier, [1], [2]), copies.copy(copier, [3], [4]),
                               return_exceptions=True)
        await asyncio.sleep(0.05)
        assert not batch.done()  # the error is known only once the wait returns
        copier.gate.set()
        assert [str(r) for r in await batch] == [copier.copy_error] * 2
        copier.copy_error = None
        await copies.copy(copier, [5], [0])

    asyncio.run(run())
    assert copier.dst.tolist() == [5, 0, 0, 0, 0, 0]


def test_waits_are_polled_then_run_on_one_long_lived_thread_not_the_executor():
    copier = HostCopier(torch.arange(4.0), torch.zeros(4))
    waited_on = set()
    launch = copier.launch

    def launch_and_note(src_ids, dst_ids, stream=None):
        done = launch(src_ids, dst_ids, stream)
        sync = done.synchronize
        done.synchronize = lambda: waited_on.add(threading.current_thread()) or sync()
        return done

    copier.launch = launch_and_note

    async def run(waiter):
        copies = CoalescedCopies(stream=None, waiter=waiter)
        for i in range(10):  # ten turns, ten launches
            await copies.copy(copier, [i % 4], [(i + 1) % 4])

    asyncio.run(run(EventWaiter(spin_seconds=0)))  # straight to the thread
    assert len(copier.launches) == 10
    assert [t.name for t in waited_on] == ["cuda-event-waiter"]
    waited_on.clear()
    polling = EventWaiter()
    asyncio.run(run(polling))  # complete at the first poll: no thread at all
    assert len(copier.launches) == 20 and not waited_on and not polling.running
