"""bench/kv_transfer.py on CPU: the grpc backend end to end (the real KVTransferServicer in a
spawned source process, pull_kv over a real gRPC channel, PayloadWriter into scattered
blocks), checked bit for bit. The caches hold random bit patterns, NaNs included: the bench
used to compare values with torch.equal, which is False for NaN == NaN, and so reported
"grpc: bytes differ" on 2 GPUs although every byte had arrived."""
from __future__ import annotations

import json

import pytest
import torch

from tandem.bench import kv_transfer
from tandem.workers.kv.block_payload import PayloadWriter, iter_payload_chunks

SMALL = ["--device", "cpu", "--layers", "3", "--kv-heads", "2", "--head-dim", "64",
         "--block-size", "4", "--iters", "2", "--warmup", "1", "--copy-mib", "4",
         "--blocks", "1,3,7"]


def test_same_bytes_compares_bits_not_values():
    a = torch.tensor([float("nan"), 1.0, -0.0], dtype=torch.bfloat16)
    assert not torch.equal(a, a.clone())  # why a value comparison cannot check a copy
    assert kv_transfer.same_bytes(a, a.clone())
    assert not kv_transfer.same_bytes(a, torch.tensor([float("nan"), 1.0, 0.0],
                                                      dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_payload_path_keeps_every_bit_of_scattered_blocks(dtype):
    """iter_payload_chunks -> PayloadWriter over several layers, K and V, scattered block ids,
    chunks that split elements: NaN and infinity bit patterns arrive unchanged."""
    gen = torch.Generator().manual_seed(3)
    shape = (4, 10, 4, 2, 8)  # 2 layers x (K, V), 10 blocks of 4 tokens, 2 heads, dim 8
    source = torch.empty(shape, dtype=dtype)
    source.view(torch.int16).random_(-2**15, 2**15, generator=gen)
    receiver = torch.zeros((4, 12, 4, 2, 8), dtype=dtype)
    src_ids, dst_ids = [7, 2, 9, 0], [11, 0, 5, 3]
    src = [(source[0], source[1]), (source[2], source[3])]
    dst = [(receiver[0], receiver[1]), (receiver[2], receiver[3])]
    writer = PayloadWriter(dst, dst_ids)
    for chunk in iter_payload_chunks(src, src_ids, chunk_bytes=99):
        writer.write(*chunk)
    writer.check_complete()
    assert source.isnan().any()
    for s, d in zip(source, receiver):
        assert kv_transfer.same_bytes(s[src_ids], d[dst_ids])
        untouched = [b for b in range(12) if b not in dst_ids]
        assert not d[untouched].view(torch.int16).any()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_bench_moves_blocks_bit_exactly_over_grpc_on_cpu(dtype, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert kv_transfer.main([*SMALL, "--dtype", dtype, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["backend"], r["blocks"]) for r in rows] == [("grpc", 1), ("grpc", 3),
                                                           ("grpc", 7)]
    assert all(r["gbps"] > 0 and r["ratio"] > 0 and r["iters"] >= 2 for r in rows)
    assert all(r["same_size_copy_ms"] > 0 and r["ratio_same_size"] > 0 for r in rows)
    table = capsys.readouterr().out
    assert "GB/s" in table and "x copy" in table and "x same" in table


def test_the_bench_reports_a_real_difference(tmp_path, monkeypatch, capsys):
    """The check is not vacuous: a receiver that drops one block's last byte fails it."""
    original = PayloadWriter.write

    def corrupt(self, layer, kv_index, offset, data):
        if layer == 1 and kv_index == 1 and offset == 0:
            data = bytes([data[0] ^ 1]) + data[1:]
        return original(self, layer, kv_index, offset, data)

    monkeypatch.setattr(PayloadWriter, "write", corrupt)
    assert kv_transfer.main(SMALL) == 1
    assert "grpc: bytes differ (1 blocks, layer 1, V)" in capsys.readouterr().err


def test_cpu_runs_refuse_cuda_backends():
    with pytest.raises(SystemExit):
        kv_transfer.parse_args(["--device", "cpu", "--backends", "grpc,cuda-ipc"])
    assert kv_transfer.parse_args(["--device", "cpu"]).backends == "grpc"


def _needs_nixl():
    from tandem.workers.kv.nixl_agent import is_installed

    if not is_installed():
        pytest.skip("nixl is an optional extra (pip install 'tandem[nixl]')")


def test_the_bench_moves_blocks_bit_exactly_over_nixl_on_cpu(tmp_path):
    """The nixl row: LeaseKV + one NIXL READ (DRAM) per pull, from the spawned source's real
    KVTransferServicer and NIXL agent, checked bit for bit like the grpc row."""
    _needs_nixl()
    out = tmp_path / "r.json"
    assert kv_transfer.main([*SMALL, "--backends", "grpc,nixl", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["backend"], r["blocks"]) for r in rows] == [
        ("grpc", 1), ("nixl", 1), ("grpc", 3), ("nixl", 3), ("grpc", 7), ("nixl", 7)]
    assert all(r["gbps"] > 0 and r["iters"] >= 2 for r in rows)


def test_the_nixl_check_reports_a_real_difference(monkeypatch, capsys):
    """A READ that leaves one byte of one block wrong fails the bench's check."""
    _needs_nixl()
    import ctypes

    from tandem.workers.kv.nixl_backend import NixlKVAgent

    original = NixlKVAgent.read_blocks

    async def corrupt(self, peer, src_ids, dst_ids, timeout):
        num_bytes = await original(self, peer, src_ids, dst_ids, timeout)
        target = self.tensors[3]  # layer 1, V (host memory: the bench runs on CPU)
        byte = ctypes.c_uint8.from_address(target.base_address
                                           + dst_ids[0] * target.block_stride_bytes)
        byte.value ^= 1
        return num_bytes

    monkeypatch.setattr(NixlKVAgent, "read_blocks", corrupt)
    assert kv_transfer.main([*SMALL, "--backends", "nixl"]) == 1
    assert "nixl: bytes differ (1 blocks, layer 1, V)" in capsys.readouterr().err
