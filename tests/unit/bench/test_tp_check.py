"""bench/tp_check.py on CPU (gloo, a tiny Llama in bf16): the whole check passes for TP=2
against TP=1, and it fails for a model that differs the way a TP bug in one row-parallel
layer would (one rank's half of an o_proj negated), although the peaked weights keep every
greedy token: the log-probability criterion is what catches it."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.bench import tp_check

TINY = ["--device", "cpu", "--model", "tiny", "--lengths", "16,40", "--tokens", "8"]


@pytest.mark.slow
def test_tp2_matches_tp1_on_cpu(capsys):
    assert tp_check.main(TINY) == 0
    out = capsys.readouterr().out
    assert "PASS: 2/2 prompts identical for 8 tokens; teacher-forced 16/16" in out
    assert "top-1 = perm[x] at 100% of positions" in out
    assert "caught)" in out  # the limit resolves a one-layer sharding bug at this size


@pytest.mark.slow
def test_a_broken_shard_fails_the_check_even_where_tokens_agree(tmp_path, capsys):
    args = tp_check.parse_args(TINY)
    path, cal = tp_check.write_checkpoint(args, tmp_path)
    assert cal["layers_logit_rms"] > 0.5 * cal["logit_rms"]  # the layers move every logit
    assert cal["bug_max"] > tp_check.dlogp_limit(cal) > cal["rounding_max"]
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    weights = load_file(broken / "model.safetensors")
    o_proj = weights["model.layers.1.self_attn.o_proj.weight"]
    o_proj[:, o_proj.shape[1] // 2:] *= -1  # rank 1's input half of a row-parallel layer
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    prompts = tp_check.make_prompts(args, 2048)
    ok, rows = tp_check.check(args, path, cal, prompts, many_path=broken, many_tp=1)
    assert not ok
    assert all(r["identical"] for r in rows)  # greedy tokens do not notice...
    assert max(r["dlogp"] for r in rows) > tp_check.dlogp_limit(cal)  # ...logprobs do
    assert "FAIL" in capsys.readouterr().out


def test_margin_and_dlogp_helpers():
    from tandem.workers.engine.sequence import TokenLogprob

    a = TokenLogprob(5, -0.1, 1, ((5, -0.1), (7, -3.0), (9, -4.0)))
    b = TokenLogprob(5, -0.2, 1, ((5, -0.2), (9, -3.5), (8, -3.9)))
    assert tp_check.margin(a) == pytest.approx(2.9)
    assert tp_check.max_dlogp(a, b) == pytest.approx(0.5)  # token 9; 7 and 8 not in both
    assert torch.isfinite(torch.tensor(tp_check.margin(b)))


def test_emulated_row_parallel_rounding_and_bug():
    """patched(): o_proj/down_proj as TP partial sums (equal to the whole matmul up to
    rounding), and the bug reference negates the last rank's input slice of one o_proj."""
    from types import SimpleNamespace

    torch.manual_seed(0)
    def linear():
        return torch.nn.Linear(8, 4, bias=False)

    layers = [SimpleNamespace(self_attn=SimpleNamespace(o_proj=linear()),
                              mlp=SimpleNamespace(down_proj=linear())) for _ in range(3)]
    model = SimpleNamespace(model=SimpleNamespace(layers=layers))
    x = torch.randn(5, 8)
    o_proj = layers[1].self_attn.o_proj
    whole = o_proj(x)
    with tp_check.patched(model, 2):
        assert torch.allclose(o_proj(x), whole, atol=1e-6)
        down = layers[0].mlp.down_proj
        assert torch.allclose(down(x), torch.nn.functional.linear(x, down.weight), atol=1e-6)
    with tp_check.patched(model, 2, bug=True):
        flipped = torch.nn.functional.linear(torch.cat([x[:, :4], -x[:, 4:]], 1), o_proj.weight)
        assert torch.allclose(o_proj(x), flipped, atol=1e-6)
        assert torch.equal(layers[0].self_attn.o_proj(x),
                           torch.nn.functional.linear(x, layers[0].self_attn.o_proj.weight))
    assert torch.equal(o_proj(x), whole)  # restored
