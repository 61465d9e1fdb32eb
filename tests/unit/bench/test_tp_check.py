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


@pytest.mark.slow
def test_a_broken_shard_fails_the_check_even_where_tokens_agree(tmp_path, capsys):
    args = tp_check.parse_args(TINY)
    path, cal = tp_check.write_checkpoint(args, tmp_path)
    assert cal["logit_var_from_layers"] > 0.3  # the layers set much of every logit
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
    assert max(r["dlogp"] for r in rows) > 0.1 * cal["layers_dlogp"]  # ...logprobs do
    assert "FAIL" in capsys.readouterr().out


def test_margin_and_dlogp_helpers():
    from tandem.workers.engine.sequence import TokenLogprob

    a = TokenLogprob(5, -0.1, 1, ((5, -0.1), (7, -3.0), (9, -4.0)))
    b = TokenLogprob(5, -0.2, 1, ((5, -0.2), (9, -3.5), (8, -3.9)))
    assert tp_check.margin(a) == pytest.approx(2.9)
    assert tp_check.max_dlogp(a, b) == pytest.approx(0.5)  # token 9; 7 and 8 not in both
    assert torch.isfinite(torch.tensor(tp_check.margin(b)))
