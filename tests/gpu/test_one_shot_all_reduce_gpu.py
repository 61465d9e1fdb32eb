"""The one-shot all-reduce (workers/parallel/one_shot_all_reduce.py) between two GPUs, two real
processes: sums equal the fp32 sum of both ranks' inputs (rounded once) and are bit-identical
on both ranks, for the decode shapes (batch x 4096), a ragged size, the largest that fits, and
bf16 / fp16 / fp32; a CUDA graph of three calls replays correctly with new inputs each time
(the epoch counters live on the device); 300 eager calls of mixed sizes stay in step; a tensor
over MAX_BYTES goes to NCCL through tp_all_reduce."""
from __future__ import annotations

import json

import pytest
import torch
from helpers.rank_processes import run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
WORLD = 2


def inputs(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 10 + rank)
    return torch.randn(numel, generator=generator).to(dtype)


def expected(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return sum(inputs(r, numel, dtype, seed).float() for r in range(WORLD)).to(dtype)


def rank_main(rank: int, init_file: str, out_path: str) -> None:
    import torch.distributed as dist

    from tandem.workers.parallel import all_reduce
    from tandem.workers.parallel.one_shot_all_reduce import MAX_BYTES, OneShotAllReduce

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD, device_id=device)
    control = dist.new_group(backend="gloo")
    results: dict = {"wrong": [], "differs": []}
    try:
        one_shot = OneShotAllReduce.create(control, device)
        results["created"] = one_shot is not None
        all_reduce.use_one_shot(one_shot)
        cases = [(4096, torch.bfloat16), (8 * 4096, torch.bfloat16), (1000, torch.bfloat16),
                 (MAX_BYTES // 2, torch.bfloat16), (2 * 4096, torch.float16),
                 (MAX_BYTES // 4, torch.float32), (3, torch.float32)]
        for seed, (numel, dtype) in enumerate(cases):
            x = inputs(rank, numel, dtype, seed).to(device)
            assert one_shot.fits(x)
            one_shot(x)
            check(results, f"eager {numel} {dtype}", x, expected(numel, dtype, seed), control)

        # A graph of three calls (as a decode step captures its layers), replayed 4 times.
        bufs = [torch.zeros(4096 * (i + 1), dtype=torch.bfloat16, device=device)
                for i in range(3)]
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for buf in bufs:
                    one_shot(buf)
        torch.cuda.current_stream(device).wait_stream(stream)
        for replay in range(4):
            for i, buf in enumerate(bufs):
                buf.copy_(inputs(rank, buf.numel(), buf.dtype, 100 + 10 * replay + i))
            graph.replay()
            for i, buf in enumerate(bufs):
                check(results, f"replay {replay} call {i}", buf,
                      expected(buf.numel(), buf.dtype, 100 + 10 * replay + i), control)

        generator = torch.Generator().manual_seed(7)  # the same sizes on both ranks
        for step in range(300):
            numel = int(torch.randint(1, MAX_BYTES // 2 + 1, (1,), generator=generator))
            x = inputs(rank, numel, torch.bfloat16, 1000 + step).to(device)
            all_reduce.tp_all_reduce(x)
            if step % 50 == 0:
                check(results, f"mixed step {step}", x,
                      expected(numel, torch.bfloat16, 1000 + step), control)
        big = inputs(rank, MAX_BYTES, torch.bfloat16, 5).to(device)  # 2x MAX_BYTES: NCCL
        results["big_fits"] = one_shot.fits(big)
        all_reduce.tp_all_reduce(big)
        torch.testing.assert_close(big.cpu().float(),
                                   expected(MAX_BYTES, torch.bfloat16, 5).float(),
                                   rtol=1e-2, atol=1e-2)
        with open(out_path, "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def check(results: dict, what: str, got: torch.Tensor, want: torch.Tensor, control) -> None:
    import torch.distributed as dist

    host = got.cpu()
    if not torch.equal(host, want):
        results["wrong"].append(what)
    both = [None] * WORLD
    dist.all_gather_object(both, host.float().sum().item(), group=control)
    if both[0] != both[1]:
        results["differs"].append(what)


def test_one_shot_all_reduce_sums_like_nccl_eager_and_in_graphs(tmp_path):
    results = run_ranks(rank_main, tmp_path, WORLD, timeout=240)
    for got in results:
        assert got["created"] and not got["big_fits"]
        assert got["wrong"] == [] and got["differs"] == [], got
