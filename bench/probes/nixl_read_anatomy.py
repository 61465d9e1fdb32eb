"""Where a NIXL READ's host time goes, between two GPUs of one host.

    python bench/probes/nixl_read_anatomy.py [--blocks 62,250,250] [--kv-heads 4]

A source process holds a KV cache on cuda:0 (32 layers, K and V, [2048 blocks, 16, kv-heads,
128] bf16: by default a TP=2 rank's share of Llama-3-8B, 1 MiB per block over all layers) and
exports its NIXL agent; this process loads it from cuda:1 and READs --blocks scattered blocks
(62 and 250 are a 1000- and a 4000-token prompt). Per READ, on the agent's own thread as the
worker runs it: building the descriptor rows, createXferReq, postXferReq, and the status polls
until done. Meanwhile a Python thread spins and records its longest stall: a NIXL call that
holds the GIL would stall it as long as the call, one that releases it not at all.
The caches here are separate tensors, so every layer's block is its own descriptor (as the
runner's layer-major cache was); the runner's block-major cache now takes one per block run.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time

import numpy as np
import torch

LAYERS, BLOCKS = 32, 2048


def make_caches(device: str, kv_heads: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (BLOCKS, 16, kv_heads, 128)
    return [(torch.randn(shape, device=device, dtype=torch.bfloat16),
             torch.randn(shape, device=device, dtype=torch.bfloat16)) for _ in range(LAYERS)]


def source_main(kv_heads: int, queue, stop) -> None:
    from tandem.common.kv_exports import to_bytes
    from tandem.common.kv_layout import KVLayout
    from tandem.workers.kv.nixl_backend import NixlKVAgent

    caches = make_caches("cuda:0", kv_heads)
    agent = NixlKVAgent(caches, KVLayout.from_kv_caches(caches))
    queue.put(to_bytes(agent.export()))
    stop.wait()
    agent.close()


def timed_read(nixl, local_rows, remote_rows, peer_name: str) -> dict:
    """On the agent's thread: create, post, poll until done, release; seconds of each."""
    bind, agent = nixl._bind, nixl._agent
    started = time.perf_counter()
    xfer = agent.createXferReq(bind.NIXL_READ, bind.nixlXferDList(bind.VRAM_SEG, local_rows),
                               bind.nixlXferDList(bind.VRAM_SEG, remote_rows), peer_name, b"",
                               [nixl._ucx])
    created = time.perf_counter()
    state = nixl._state(agent.postXferReq(xfer, b""))
    posted = time.perf_counter()
    polls = 0
    while state == "PROC":
        time.sleep(1e-4)
        state = nixl._state(agent.getXferStatus(xfer))
        polls += 1
    done = time.perf_counter()
    agent.releaseXferReq(xfer)
    return dict(create=created - started, post=posted - created, polls=polls,
                until_done=done - posted, state=state)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python bench/probes/nixl_read_anatomy.py")
    p.add_argument("--blocks", default="62,250,250")
    p.add_argument("--kv-heads", type=int, default=4)
    args = p.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print("nixl_read_anatomy: needs 2 CUDA GPUs", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    from tandem.common.kv_exports import nixl_export_from_bytes
    from tandem.common.kv_layout import KVLayout
    from tandem.workers.kv.nixl_backend import NixlKVAgent, block_runs, descriptor_rows

    ctx = mp.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    source = ctx.Process(target=source_main, args=(args.kv_heads, queue, stop))
    source.start()
    try:
        export = nixl_export_from_bytes(queue.get(timeout=300))
        torch.cuda.set_device(1)
        caches = make_caches("cuda:1", args.kv_heads)
        agent = NixlKVAgent(caches, KVLayout.from_kv_caches(caches))
        peer = agent.add_peer(export)
        rng = np.random.default_rng(0)
        print(f"{'blocks':>6} {'descs':>6} {'rows ms':>8} {'create':>7} {'post':>8} "
              f"{'polls':>5} {'after':>7} {'spin stall':>10}")
        for n in (int(b) for b in args.blocks.split(",")):
            src, dst = rng.permutation(BLOCKS)[:n], rng.permutation(BLOCKS)[:n]
            started = time.perf_counter()
            runs = block_runs(src.tolist(), dst.tolist())
            local = descriptor_rows(agent.tensors, runs[:, 1], runs[:, 2])
            remote = descriptor_rows(peer.tensors, runs[:, 0], runs[:, 2])
            rows_s = time.perf_counter() - started
            stalls, spinning = [0.0], True

            def spin():
                last = time.perf_counter()
                while spinning:
                    now = time.perf_counter()
                    stalls[0] = max(stalls[0], now - last)
                    last = now
                    time.sleep(0)

            spinner = threading.Thread(target=spin)
            spinner.start()
            t = agent._agent._call(timed_read, agent._agent, local, remote, peer.agent_name)
            spinning = False
            spinner.join()
            print(f"{n:6d} {len(local):6d} {rows_s * 1e3:8.2f} {t['create'] * 1e3:7.2f} "
                  f"{t['post'] * 1e3:8.2f} {t['polls']:5d} {t['until_done'] * 1e3:7.2f} "
                  f"{stalls[0] * 1e3:10.2f}   ms ({t['state']})", flush=True)
        agent.remove_peer(peer)
        agent.close()
    finally:
        stop.set()
        source.join(30)
        if source.is_alive():
            source.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
