"""Scheduler policy with a real BlockManager and real Sequences (no model: steps are simulated
by advancing num_computed_tokens and appending a token, exactly as the engine does)."""
from __future__ import annotations

from tandem import SamplingParams
from tandem.workers.engine.block_manager import BlockManager
from tandem.workers.engine.scheduler import Scheduler, SchedulerOutput
from tandem.workers.engine.sequence import FinishReason, Sequence, SequenceStatus

PARAMS = SamplingParams(max_tokens=100)


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=16, prefix_caching=False):
    manager = BlockManager(num_blocks, block_size, prefix_caching)
    return Scheduler(manager, max_num_seqs, budget), manager


def complete_step(out: SchedulerOutput, token: int = 7) -> None:
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        if item.is_sampled:
            item.seq.append_token(token)


def test_long_prompt_is_chunked_within_the_budget_and_prefill_comes_first():
    scheduler, _ = make(budget=16)
    long_seq, short_seq = Sequence(list(range(40)), PARAMS), Sequence([1, 2, 3], PARAMS)
    scheduler.add(long_seq)
    chunks = []
    while long_seq.num_completion_tokens == 0:
        out = scheduler.schedule()
        assert out.is_prefill and out.num_tokens <= 16
        chunks.append([(i.seq.seq_id, i.num_new_tokens, i.is_sampled) for i in out.scheduled])
        complete_step(out)
        if len(chunks) == 1:
            scheduler.add(short_seq)  # arrives mid-prefill: joins the next prefill step
    assert chunks[0] == [(long_seq.seq_id, 16, False)]
    assert chunks[1] == [(long_seq.seq_id, 16, False)]
    assert chunks[2] == [(long_seq.seq_id, 8, True), (short_seq.seq_id, 3, True)]
    out = scheduler.schedule()
    assert not out.is_prefill and [i.num_new_tokens for i in out.scheduled] == [1, 1]


def test_max_num_seqs_limits_admission():
    scheduler, _ = make(max_num_seqs=2, budget=100)
    seqs = [Sequence([1, 2], PARAMS) for _ in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    out = scheduler.schedule()
    assert [i.seq for i in out.scheduled] == seqs[:2]
    assert seqs[2].status is SequenceStatus.WAITING


def test_preemption_frees_the_latest_admitted_and_requeues_it_first():
    # 6 blocks of 4 tokens; three 8-token prompts take 2 blocks each; the next decode token of
    # the first sequence needs a 3rd block, so the last admitted is preempted.
    scheduler, manager = make(num_blocks=6, block_size=4, budget=100)
    seqs = [Sequence(list(range(8)), PARAMS) for _ in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    complete_step(scheduler.schedule())  # prefill all three: 9 tokens each now, 8 computed
    out = scheduler.schedule()
    assert not out.is_prefill
    assert out.preempted == [seqs[2]]
    assert seqs[2].status is SequenceStatus.WAITING and seqs[2].block_table == []
    assert scheduler.waiting[0] is seqs[2] and seqs[2].num_preemptions == 1
    assert [i.seq for i in out.scheduled] == seqs[:2]
    complete_step(out)
    manager.check_invariants(list(scheduler.running))


def test_finish_frees_blocks_from_running_and_waiting():
    scheduler, manager = make(budget=100)
    running, waiting = Sequence([1] * 9, PARAMS), Sequence([2] * 3, PARAMS)
    scheduler.add(running)
    complete_step(scheduler.schedule())
    scheduler.add(waiting)
    scheduler.finish(running, FinishReason.ABORT)
    scheduler.finish(waiting, FinishReason.ABORT)
    assert not scheduler.has_unfinished
    assert manager.num_free_blocks == manager.num_blocks
    assert running.finish_reason is FinishReason.ABORT and running.is_finished
