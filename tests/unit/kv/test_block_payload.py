"""Block payloads over any per-layer tuple of cache tensors: selected blocks arrive intact in
other block ids, and nothing else changes."""
from __future__ import annotations

import pytest
import torch

from tandem.workers.kv.block_payload import PayloadWriter, iter_payload_chunks


def _caches(shapes_per_layer, num_blocks, seed):
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(num_blocks, *shape, generator=gen) for shape in shapes)
            for shapes in shapes_per_layer]


@pytest.mark.parametrize("shapes", [
    [[(4, 2, 8), (4, 2, 8)]] * 2,  # MHA: K and V per layer
    [[(4, 1, 40)]] * 3,  # MLA: one latent per layer
    [[(4, 1, 40), (4, 1, 16)]] * 2,  # any op's tuple, e.g. a latent plus an index key cache
])
def test_selected_blocks_arrive_in_the_receivers_blocks(shapes):
    source, receiver = _caches(shapes, 10, seed=0), _caches(shapes, 12, seed=1)
    before = [tuple(c.clone() for c in caches) for caches in receiver]
    src_blocks, dst_blocks = [7, 2, 9], [0, 11, 5]
    writer = PayloadWriter(receiver, dst_blocks)
    for chunk in iter_payload_chunks(source, src_blocks, chunk_bytes=100):
        writer.write(*chunk)
    writer.check_complete()
    untouched = [b for b in range(12) if b not in dst_blocks]
    for src, dst, old in zip(source, receiver, before):
        for s, d, o in zip(src, dst, old):
            assert torch.equal(d[dst_blocks], s[src_blocks])
            assert torch.equal(d[untouched], o[untouched])


def test_blocks_arriving_in_pieces_and_out_of_order_are_assembled():
    """Another sender may cut chunks anywhere: pieces of a block are assembled before the
    block is written, and a block is written only whole."""
    shapes = [[(4, 2, 8), (4, 2, 8)]] * 2
    source, receiver = _caches(shapes, 10, seed=2), _caches(shapes, 12, seed=3)
    src_blocks, dst_blocks = [3, 8, 1, 4], [10, 2, 7, 0]
    pieces = []
    for layer, kv_index, offset, data in iter_payload_chunks(source, src_blocks):
        for start in range(0, len(data), 100):  # 100-byte pieces of 256-byte blocks
            pieces.append((layer, kv_index, offset + start, data[start: start + 100]))
    pieces.reverse()
    assert pieces[0][:2] == (1, 1)  # the last payload's last piece comes first
    writer = PayloadWriter(receiver, dst_blocks)
    before = receiver[1][1][dst_blocks[-1]].clone()
    writer.write(*pieces[0])
    assert torch.equal(receiver[1][1][dst_blocks[-1]], before)  # a block's tail alone: unwritten
    for piece in pieces[1:]:
        writer.write(*piece)
    writer.check_complete()
    for src, dst in zip(source, receiver):
        for s, d in zip(src, dst):
            assert torch.equal(d[dst_blocks], s[src_blocks])


def test_chunks_hold_whole_blocks():
    source = _caches([[(4, 2, 8)]], 40, seed=4)  # 256-byte blocks
    chunks = list(iter_payload_chunks(source, list(range(30)), chunk_bytes=1000))
    assert [len(data) for *_, data in chunks] == [768] * 10  # 3 blocks each, under 1000
    assert [offset for _, _, offset, _ in chunks] == list(range(0, 7680, 768))


def test_a_missing_tensor_payload_is_named():
    shapes = [[(4, 1, 40), (4, 1, 16)]] * 2
    source, receiver = _caches(shapes, 4, seed=0), _caches(shapes, 4, seed=1)
    writer = PayloadWriter(receiver, [1, 2])
    for layer, kv_index, offset, data in iter_payload_chunks(source, [1, 2]):
        if (layer, kv_index) != (1, 1):
            writer.write(layer, kv_index, offset, data)
    with pytest.raises(ValueError, match=r"1 of 4 payloads missing.*layer 1, kv_index 1"):
        writer.check_complete()
    with pytest.raises(ValueError, match="layer 0, kv_index 2 is out of range"):
        writer.write(0, 2, 0, b"\0")
