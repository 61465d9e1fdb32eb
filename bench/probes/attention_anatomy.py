"""Where the time of batch-1 decode attention goes: the split-KV kernel taken apart.

    python bench/probes/attention_anatomy.py [--context 4096]

Every row is a CUDA-graph replay (bench/engine_limits.time_graphed) with the KV rotated
through copies so it comes from HBM, at Llama-8B's heads (32 q / 8 kv, head 128, block 16):

    full              split pass + combine, as the engine runs it, then a sweep of split
                      counts and tiles with and without the first tile loaded before the
                      PDL wait (prefetch, paged_decode.py)
    split pass only   the combine is skipped
    combine only      the second pass alone, on partials already written
    no keys           both passes with seq_len 0: launch, prologue and kernel boundaries
    read, contiguous  a bare Triton kernel summing the same number of KV bytes, laid out
                      contiguously, with as many programs as the split pass: the read floor
    read, paged       the same sum over the split pass's exact addresses (block table, one KV
                      head per program), without the attention math
Fractions are KV bytes / time / the copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl

from tandem.bench.engine_limits import measure_limits, time_graphed
from tandem.bench.engine_ops import decode_attention_inputs
from tandem.workers.ops.gpu import paged_decode
from tandem.workers.ops.gpu.paged_decode import combine_splits, paged_decode_attention

BF16 = torch.bfloat16


@triton.jit
def _read_contiguous(ptr, out_ptr, per_program, TILE: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * per_program
    acc = tl.zeros([TILE], tl.float32)
    for start in range(0, per_program, TILE):
        acc += tl.load(ptr + base + start + tl.arange(0, TILE)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


@triton.jit
def _read_paged(k_ptr, v_ptr, table_ptr, out_ptr, per_split, stride_block, stride_slot,
                stride_head, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_N: tl.constexpr):
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    lo = split * per_split
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for start in range(lo, lo + per_split, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        block = tl.load(table_ptr + pos // BLOCK_SIZE).to(tl.int64)
        off = block * stride_block + (pos % BLOCK_SIZE) * stride_slot + kv_head * stride_head
        acc += tl.load(k_ptr + off[:, None] + offs_d[None, :]).to(tl.float32)
        acc += tl.load(v_ptr + off[:, None] + offs_d[None, :]).to(tl.float32)
    tl.store(out_ptr + kv_head * tl.num_programs(2) + split, tl.sum(tl.sum(acc, 1), 0))


def anatomy(context: int, copy_bps: float, block_n: int = 64) -> list[tuple[str, float]]:
    heads, kv_heads, dim, block_size = 32, 8, 128, 16
    inputs = decode_attention_inputs(1, context, heads, kv_heads, dim, block_size)
    q, caches, table, seq_lens = inputs.q, inputs.caches, inputs.tables, inputs.seq_lens
    kv_bytes, splits = inputs.kv_bytes, inputs.splits
    no_keys = torch.zeros_like(seq_lens)
    scale = dim ** -0.5
    rows = []

    def attend(lens, splits=splits, **kw):
        return lambda i: paged_decode_attention(q, *caches[i % len(caches)], table, lens, scale,
                                                num_splits=splits, **kw)
    rows.append((f"full ({splits} splits, 64-key tiles, prefetch)",
                 time_graphed(attend(seq_lens))))
    for n_splits, tile, prefetch in itertools.product((16, 32, 64), (32, 64), (False, True)):
        if context // n_splits >= tile:
            rows.append((f"full {n_splits} splits, {tile}-key tiles"
                         + (", prefetch" if prefetch else ""),
                         time_graphed(attend(seq_lens, block_n=tile, splits=n_splits,
                                             prefetch=prefetch))))
    rows.append(("no keys (seq_len 0)", time_graphed(attend(no_keys, prefetch=False))))
    real_combine = paged_decode.combine_splits
    paged_decode.combine_splits = lambda *a, **k: None
    try:
        rows.append(("split pass only", time_graphed(attend(seq_lens, prefetch=False))))
        rows.append(("split pass only, prefetch", time_graphed(attend(seq_lens))))
    finally:
        paged_decode.combine_splits = real_combine
    part_out = torch.randn(1, heads, splits, dim, device="cuda")
    part_lse = torch.randn(1, heads, splits, device="cuda")
    out = torch.empty_like(q)
    rows.append(("combine only", time_graphed(lambda i: combine_splits(part_out, part_lse,
                                                                          out))))
    flat = [torch.cat([k.flatten(), v.flatten()]) for k, v in caches]
    sums = torch.empty(kv_heads * splits, device="cuda")
    per_program = flat[0].numel() // (kv_heads * splits)
    for tile in (2048, 8192):
        rows.append((f"read, contiguous ({kv_heads * splits} programs, tile {tile})",
                     time_graphed(lambda i: _read_contiguous[(kv_heads * splits,)](
                         flat[i % len(flat)], sums, per_program, TILE=tile, num_warps=4))))
    k0 = caches[0][0]
    rows.append(("read, paged (split pass's addresses)", time_graphed(
        lambda i: _read_paged[(1, kv_heads, splits)](
            *caches[i % len(caches)], table, sums, context // splits, k0.stride(0),
            k0.stride(1), k0.stride(2), BLOCK_SIZE=block_size, HEAD_DIM=dim,
            BLOCK_N=block_n, num_warps=4, num_stages=2))))
    return [(name, seconds, kv_bytes / seconds / copy_bps) for name, seconds in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args()
    limits = measure_limits()
    print(f"{limits.name}: copy {limits.copy_bytes_per_s / 1e12:.2f} TB/s")
    for name, seconds, fraction in anatomy(args.context, limits.copy_bytes_per_s):
        print(f"  {name:<46} {seconds * 1e6:7.2f} us  {fraction:5.0%} of copy BW")


if __name__ == "__main__":
    main()
