"""How TP ranks agree on their KV block count (PROFILE_MEMORY, then KV_BLOCKS; rank_runner.py),
over a real 2-process gloo group on CPU: every rank sizes its own cache and the smallest count
wins; a rank whose cache does not fit raises its own error and the others one naming it, with
the group still in step; without PROFILE_MEMORY (CPU, or num_kv_blocks given) a follower takes
rank 0's count without sizing. The GPU profile itself: tests/gpu (every TP engine start)."""
from __future__ import annotations

import json

import torch.distributed as dist
from helpers.rank_processes import run_ranks

from tandem.workers.parallel.control_gathers import failed_ranks
from tandem.workers.parallel.messages import Command, make_header
from tandem.workers.executor.rank_runner import RankGroup, num_kv_blocks_from_leader

WORLD = 2


def leader() -> RankGroup:
    """Rank 0's RankGroup over the default group (its followers are the other test process)."""
    group = object.__new__(RankGroup)
    group.control_group = None
    return group


def outcome(run) -> object:
    try:
        return run()
    except ValueError as exc:
        return f"ValueError: {exc}"


def rank_main(rank: int, init_file: str, out_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    try:
        results, asked = {}, []

        def follower_size(count):
            def size_own(uses_cuda_graphs: bool) -> int:
                asked.append(uses_cuda_graphs)
                if count is None:
                    raise ValueError("the weights (9.00 GiB) do not fit")
                return count
            return size_own

        for case, (rank0_count, rank1_count) in {"smallest": (500, 300),
                                                 "rank 1 fails": (500, None),
                                                 "rank 0 fails": (None, 300)}.items():
            if rank == 0:
                def size_own(count=rank0_count) -> int:
                    if count is None:
                        raise ValueError("the weights (9.00 GiB) do not fit")
                    return count
                group = leader()
                results[case] = outcome(lambda: group.smallest_kv_blocks(size_own, True))
                if isinstance(results[case], int):  # else the engine fails and stops the group
                    group.send(make_header(Command.KV_BLOCKS, results[case]))
            else:
                results[case] = outcome(lambda: num_kv_blocks_from_leader(
                    None, follower_size(rank1_count)))
        if rank == 0:  # the CPU / num_kv_blocks path: KV_BLOCKS alone, rank 0's count
            leader().send(make_header(Command.KV_BLOCKS, 77))
        else:
            results["no profile"] = num_kv_blocks_from_leader(None, follower_size(1))
        results["asked"] = asked
        results["in step"] = failed_ranks(True, None)
        with open(out_path, "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_the_smallest_count_and_name_a_rank_that_cannot_fit(tmp_path):
    rank0, rank1 = run_ranks(rank_main, tmp_path, WORLD)
    assert rank0["smallest"] == rank1["smallest"] == 300
    own_error = "ValueError: the weights (9.00 GiB) do not fit"
    assert rank1["rank 1 fails"] == own_error
    assert rank0["rank 1 fails"].startswith("ValueError: the KV cache does not fit on TP rank(s) "
                                            "[1]")
    assert rank0["rank 0 fails"] == own_error
    assert rank1["rank 0 fails"].startswith("ValueError: the KV cache does not fit on TP rank(s) "
                                            "[0]")
    assert rank1["no profile"] == 77
    assert rank1["asked"] == [True, True, True]  # the flag reached it; KV_BLOCKS alone sized none
    assert rank0["in step"] == rank1["in step"] == []
