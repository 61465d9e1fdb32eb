"""Extreme but accepted sampling values sample correctly; values past the bounds are refused."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.common.sampling_params import (MAX_REPETITION_PENALTY, MIN_RANDOM_TEMPERATURE,
                                           MIN_REPETITION_PENALTY, SamplingParams)
from tandem.workers.engine.sampler import Sampler, apply_penalties
from tandem.workers.engine.sequence import Sequence

VOCAB = 32
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@pytest.mark.parametrize("value", [1e-38, 1e-3, 0.0, -1.0, 101.0, math.inf])
def test_repetition_penalty_out_of_range_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=value)


@pytest.mark.parametrize("temperature", [1.401298464324817e-45, 1e-30, 9.9e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature):
    params = SamplingParams(temperature=temperature)
    assert params.is_greedy
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    out = Sampler(seed=0)(logits, [Sequence([1, 2], params) for _ in range(4)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert not SamplingParams(temperature=MIN_RANDOM_TEMPERATURE).is_greedy


def test_a_rewarding_penalty_on_huge_logits_still_picks_the_top_token():
    """A seen token's logit divided by a penalty < 1 may overflow to +inf; that token must
    win (it is the most likely), not turn the row into NaN and an arbitrary token."""
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 7] = 1e37
    logits[0, 3] = 2e37
    seq = Sequence([7], SamplingParams(repetition_penalty=MIN_REPETITION_PENALTY))
    assert Sampler(seed=0)(logits, [seq]).token_ids == [7]


finite_logit = st.floats(-FLOAT32_MAX, FLOAT32_MAX, width=32)


@settings(max_examples=300, deadline=None)
@given(logits=st.lists(finite_logit, min_size=VOCAB, max_size=VOCAB),
       prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
       temperature=st.one_of(st.just(0.0), st.floats(0, 100, width=32)),
       top_k=st.integers(0, VOCAB), top_p=st.floats(1e-6, 1.0),
       min_p=st.floats(0.0, 1.0),
       repetition_penalty=st.floats(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
       presence_penalty=st.floats(-2, 2), frequency_penalty=st.floats(-2, 2),
       seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)))
def test_any_accepted_params_sample_a_token_the_filters_allow(logits, prompt, **params):
    """Over the whole accepted range and any finite fp32 logits: one valid token per row, never
    one that penalties and top_k rank below the k-th (NaN rows would pick token 0)."""
    sampling = SamplingParams(**params)
    seq = Sequence(prompt, sampling)
    row = torch.tensor([logits], dtype=torch.float32)
    (token,) = Sampler(seed=0)(row, [seq]).token_ids
    assert 0 <= token < VOCAB
    penalized = apply_penalties(row, [seq])[0].nan_to_num(posinf=FLOAT32_MAX)
    assert not torch.isnan(penalized).any()
    if sampling.is_greedy:
        assert penalized[token] == penalized.max()
    elif 0 < sampling.top_k < VOCAB:
        assert penalized[token] >= penalized.topk(sampling.top_k).values[-1]
