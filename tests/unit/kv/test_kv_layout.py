"""KVLayout from a runner's caches (MHA pairs, MLA latents) and what a receiver refuses."""
from __future__ import annotations

import pytest
import torch

from tandem.common.kv_layout import KVLayout, KVLayoutMismatch


def _mha(num_layers=2, heads=2, dim=16, dtype=torch.float32):
    return [(torch.zeros(5, 16, heads, dim, dtype=dtype),) * 2 for _ in range(num_layers)]


def _mla(num_layers=3, latent_dim=40, dtype=torch.float32):
    return [(torch.zeros(5, 16, 1, latent_dim, dtype=dtype),) for _ in range(num_layers)]


def test_layout_kind_follows_the_tensors_each_layer_keeps():
    assert KVLayout.from_kv_caches(_mha()) == KVLayout("mha", 2, 16, 2, 16, "float32")
    mla = KVLayout.from_kv_caches(_mla(dtype=torch.bfloat16))
    assert mla == KVLayout("mla", 3, 16, 1, 40, "bfloat16")
    assert mla.bytes_per_block == 16 * 40 * 2


def test_an_mha_worker_refuses_mla_blocks_naming_both_kinds():
    mla, mha = KVLayout.from_kv_caches(_mla()), KVLayout.from_kv_caches(_mha())
    with pytest.raises(KVLayoutMismatch, match=r"source keeps a 'mla' KV cache and this worker "
                                                r"a 'mha' one.*kind: source 'mla' != receiver "
                                                r"'mha'.*head_dim: source 40 != receiver 16"):
        mla.check_readable_by(mha)
    with pytest.raises(KVLayoutMismatch, match="source keeps a 'mha' KV cache"):
        mha.check_readable_by(mla)
    mla.check_readable_by(KVLayout.from_kv_caches(_mla()))


@pytest.mark.parametrize("caches,message", [
    ([], "kv_caches is empty"),
    (_mla()[:1] + _mla(latent_dim=24)[:1], "layer 1 holds different cache tensors"),
    ([tuple(_mha()[0]) + _mla()[0]], "neither MHA's"),
    ([(torch.zeros(5, 16, 2, 8), torch.zeros(5, 16, 2, 4))], "neither MHA's"),
    ([(torch.zeros(5, 16, 2, 40),)], "MLA latent cache has 1 head, not 2"),
])
def test_caches_that_fit_no_layout_are_named(caches, message):
    with pytest.raises(ValueError, match=message):
        KVLayout.from_kv_caches(caches)


def _sparse_mla(num_layers=2, latent_dim=40, index_dim=16):
    return [(torch.zeros(5, 16, 1, latent_dim), torch.zeros(5, 16, 1, index_dim))
            for _ in range(num_layers)]


def test_sparse_mla_carries_the_indexer_key_width_and_refuses_plain_mla():
    dsa = KVLayout.from_kv_caches(_sparse_mla())
    assert dsa == KVLayout("mla_indexer", 2, 16, 1, 40, "float32", index_head_dim=16)
    assert dsa.bytes_per_block == 16 * 40 * 4
    assert dsa.bytes_per_layer_block == 16 * (40 + 16) * 4
    assert KVLayout.from_kv_caches(_mha()).bytes_per_layer_block == 2 * 16 * 2 * 16 * 4
    mla = KVLayout.from_kv_caches(_mla())
    with pytest.raises(KVLayoutMismatch, match=r"source keeps a 'mla' KV cache and this worker "
                                                r"a 'mla_indexer' one.*indexer keys.*"
                                                r"index_head_dim: source 0 != receiver 16"):
        mla.check_readable_by(dsa)
    with pytest.raises(KVLayoutMismatch, match="index_head_dim: source 16 != receiver 8"):
        dsa.check_readable_by(KVLayout.from_kv_caches(_sparse_mla(index_dim=8)))
    dsa.check_readable_by(KVLayout.from_kv_caches(_sparse_mla()))


def test_declared_kind_decides_where_shapes_alone_are_ambiguous():
    """Latent and indexer keys of one width look like single-head K and V."""
    same_width = _sparse_mla(latent_dim=16, index_dim=16)
    assert KVLayout.from_kv_caches(same_width).kind == "mha"
    dsa = KVLayout.from_kv_caches(same_width, kind="mla_indexer")
    assert (dsa.kind, dsa.index_head_dim) == ("mla_indexer", 16)
    with pytest.raises(ValueError, match="do not make a 'mla' cache"):
        KVLayout.from_kv_caches(_sparse_mla(), kind="mla")
    with pytest.raises(ValueError, match="do not make a 'mha' cache"):
        KVLayout.from_kv_caches(_sparse_mla(), kind="mha")
    with pytest.raises(ValueError, match="1 head, not 2"):
        KVLayout.from_kv_caches(_mha(), kind="mla_indexer")
    with pytest.raises(ValueError, match="unknown KV cache kind 'gqa'"):
        KVLayout.from_kv_caches(_mha(), kind="gqa")


def test_layout_survives_the_proto_round_trip():
    from tandem.common.convert import layout_from_proto, layout_to_proto

    for layout in (KVLayout.from_kv_caches(_sparse_mla()), KVLayout.from_kv_caches(_mha())):
        assert layout_from_proto(layout_to_proto(layout)) == layout
