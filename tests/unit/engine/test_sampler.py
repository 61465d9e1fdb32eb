"""Sampler: greedy, seeded and truncated random sampling, penalties, min_tokens, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from tandem.common.sampling_params import SamplingParams
from tandem.workers.engine.sampler import Sampler, SamplerOutput, apply_penalties
from tandem.workers.engine.sequence import Sequence

EOS = 0
# The GPU path (per-request CUDA generators, indexing on device) runs where a GPU exists.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make_seq(prompt=(1, 2, 3), completion=(), **params) -> Sequence:
    params.setdefault("max_tokens", 64)
    seq = Sequence(list(prompt), SamplingParams(**params))
    for token in completion:
        seq.append_token(token)
    return seq


def draw_many(row: torch.Tensor, num_draws: int, device: str = "cpu", **params) -> torch.Tensor:
    """Samples num_draws tokens from one logit row, as one batch of identical unseeded requests."""
    sampling_params = SamplingParams(**params)
    seqs = [Sequence([1, 2, 3], sampling_params) for _ in range(num_draws)]
    out = Sampler(seed=0)(row.to(device).expand(num_draws, -1), seqs)
    return torch.tensor(out.token_ids)


def frequencies(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab_size).double() / tokens.numel()


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((observed - expected) ** 2 / expected).sum())


# ---- greedy --------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", [
    dict(temperature=0.0),
    dict(temperature=0.0, top_p=0.3, min_p=0.2, seed=5),
    dict(temperature=1.5, top_k=1),
])
def test_greedy_rows_take_the_argmax(params, device):
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0)).to(device)
    for _ in range(3):
        out = Sampler()(logits, [make_seq(**params) for _ in range(8)])
        assert out.token_ids == logits.cpu().argmax(dim=-1).tolist()
        assert all(isinstance(t, int) for t in out.token_ids)


def test_greedy_ties_go_to_lowest_id_and_low_precision_input_is_accepted():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [3.0, 3.0, 3.0, 3.0]], dtype=torch.bfloat16)
    out = Sampler()(logits, [make_seq(temperature=0), make_seq(temperature=0)])
    assert out == SamplerOutput(token_ids=[1, 0], logprobs=[None, None])


def test_sampler_leaves_the_callers_logits_alone_and_checks_shapes():
    logits = torch.randn(2, 16)
    before = logits.clone()
    seqs = [make_seq(completion=[4, 4], repetition_penalty=2.0, frequency_penalty=1.0, top_p=0.5,
                     min_tokens=5, logprobs=1), make_seq(min_p=0.3)]
    Sampler(eos_token_ids=[EOS])(logits, seqs)
    assert torch.equal(logits, before)
    assert Sampler()(torch.empty(0, 16), []) == SamplerOutput([], [])
    with pytest.raises(ValueError):
        Sampler()(logits, seqs[:1])


# ---- seeds ---------------------------------------------------------------------------------

def _run_steps(sampler: Sampler, seqs: list[Sequence], steps: list[torch.Tensor],
               device: str = "cpu") -> None:
    for logits in steps:
        out = sampler(logits.to(device), seqs)
        for seq, token in zip(seqs, out.token_ids):
            seq.append_token(token)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_request_gets_the_same_tokens_alone_and_inside_a_batch(device):
    gen = torch.Generator().manual_seed(1)
    steps = [torch.randn(6, 64, generator=gen) for _ in range(20)]
    target = dict(temperature=0.9, top_p=0.95, repetition_penalty=1.1, seed=1234)

    alone = make_seq(**target)
    _run_steps(Sampler(seed=1), [alone], [logits[3:4] for logits in steps], device)

    batch = [make_seq(seed=7), make_seq(), make_seq(temperature=0), make_seq(**target),
             make_seq(seed=99, top_k=5, presence_penalty=0.5), make_seq(temperature=0.5, logprobs=2)]
    _run_steps(Sampler(seed=2), batch, steps, device)
    assert batch[3].completion_token_ids == alone.completion_token_ids

    # Row 0 of a smaller batch, beside a request with the same seed but other logits.
    other = make_seq(**target)
    front = make_seq(**target)
    _run_steps(Sampler(seed=3), [front, other],
               [torch.stack([logits[3], logits[0]]) for logits in steps], device)
    assert front.completion_token_ids == alone.completion_token_ids
    assert len(set(alone.completion_token_ids)) > 5  # really sampled, not stuck on one token


def test_different_seeds_give_different_tokens_and_same_seeds_agree():
    seqs = [make_seq(seed=1), make_seq(seed=2), make_seq(seed=1)]
    _run_steps(Sampler(), seqs, [torch.zeros(3, 50)] * 20)
    assert seqs[0].completion_token_ids != seqs[1].completion_token_ids
    assert seqs[0].completion_token_ids == seqs[2].completion_token_ids


def test_unseeded_rows_follow_the_sampler_seed():
    logits = torch.zeros(4, 1000)
    first = Sampler(seed=11)(logits, [make_seq() for _ in range(4)]).token_ids
    again = Sampler(seed=11)(logits, [make_seq() for _ in range(4)]).token_ids
    other = Sampler(seed=12)(logits, [make_seq() for _ in range(4)]).token_ids
    assert first == again != other


# ---- truncation and the sampled distribution -----------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_top_k_only_samples_the_k_most_likely_tokens(device):
    row = torch.randn(40, generator=torch.Generator().manual_seed(3))
    tokens = draw_many(row, 3000, device, top_k=4, temperature=2.0)
    assert set(tokens.tolist()) == set(row.topk(4).indices.tolist())


@pytest.mark.parametrize("top_k", [0, -1, 8, 9])
def test_top_k_off_or_at_least_the_vocab_keeps_every_token(top_k):
    tokens = draw_many(torch.zeros(8), 500, top_k=top_k)
    assert set(tokens.tolist()) == set(range(8))


@pytest.mark.parametrize("device", DEVICES)
def test_top_p_never_samples_outside_the_nucleus(device):
    probs = torch.tensor([0.05, 0.3, 0.1, 0.4, 0.15])  # nucleus for 0.8: tokens 3, 1, 4
    tokens = draw_many(probs.log(), 4000, device, top_p=0.8)
    assert set(tokens.tolist()) == {1, 3, 4}
    kept = torch.tensor([0.0, 0.3, 0.0, 0.4, 0.15]) / 0.85
    assert torch.allclose(frequencies(tokens, 5), kept.double(), atol=0.03)
    assert set(draw_many(probs.log(), 200, device, top_p=0.01).tolist()) == {3}  # never empty


def test_top_p_applies_after_temperature_and_top_k():
    probs = torch.tensor([0.35, 0.3, 0.2, 0.1, 0.05])
    # top_k=3 renormalizes to 0.41/0.35/0.24: top_p=0.7 keeps the two most likely.
    tokens = draw_many(probs.log(), 2000, top_k=3, top_p=0.7)
    assert set(tokens.tolist()) == {0, 1}


def test_min_p_never_samples_below_the_threshold():
    probs = torch.tensor([0.06, 0.5, 0.09, 0.2, 0.1, 0.05])  # 0.19 * 0.5 = 0.095: keep 1, 3, 4
    tokens = draw_many(probs.log(), 2000, min_p=0.19)
    assert set(tokens.tolist()) == {1, 3, 4}


@pytest.mark.parametrize("device", DEVICES)
def test_temperature_sampling_matches_the_softmax(device):
    row = torch.randn(6, generator=torch.Generator().manual_seed(5))
    expected = torch.softmax(row / 0.7, dim=-1)
    tokens = draw_many(row, 10000, device, temperature=0.7)
    assert chi_square(tokens, expected) < 25.7  # 5 degrees of freedom, p = 1e-4


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_sample_from_the_softmax_too(device):
    row = torch.randn(6, generator=torch.Generator().manual_seed(6))
    seqs = [make_seq(seed=i) for i in range(2000)]
    tokens = torch.tensor(Sampler()(row.to(device).expand(2000, -1), seqs).token_ids)
    assert chi_square(tokens, torch.softmax(row, dim=-1)) < 25.7


# ---- penalties -----------------------------------------------------------------------------

def test_repetition_penalty_moves_greedy_away_from_seen_tokens():
    sampler = Sampler()
    positive = torch.tensor([[0.0, 5.0, 4.0, 1.0]])  # token 1 is in the prompt
    assert sampler(positive, [make_seq(prompt=[1], temperature=0)]).token_ids == [1]
    assert sampler(positive, [make_seq(prompt=[1], temperature=0,
                                       repetition_penalty=1.5)]).token_ids == [2]
    negative = torch.tensor([[-3.0, -1.0, -1.2, -5.0]])  # token 1 only in the completion
    seq = make_seq(prompt=[3], completion=[1], temperature=0, repetition_penalty=1.5)
    assert sampler(negative, [seq]).token_ids == [2]
    rewarding = make_seq(prompt=[2], temperature=0, repetition_penalty=0.5)
    assert sampler(negative, [rewarding]).token_ids == [2]  # -1.2 * 0.5 = -0.6


def test_apply_penalties_values():
    logits = torch.tensor([[1.0, 4.0, -1.0, 3.0, -2.0, 0.5],
                           [1.0, 4.0, -1.0, 3.0, -2.0, 0.5]])
    before = logits.clone()
    seqs = [make_seq(prompt=[1, 2], completion=[2, 3, 3], repetition_penalty=2.0,
                     frequency_penalty=0.5, presence_penalty=0.25),
            make_seq(prompt=[1, 2], completion=[2, 3, 3])]
    out = apply_penalties(logits, seqs)
    # 0: unseen; 1: prompt only (4 / 2); 2: prompt and once in completion (-1 * 2 - 0.5 - 0.25);
    # 3: twice in completion (3 / 2 - 1.0 - 0.25); 4, 5: unseen.
    assert out[0].tolist() == [1.0, 2.0, -2.75, 0.25, -2.0, 0.5]
    assert torch.equal(out[1], logits[1])
    assert torch.equal(logits, before)


def test_frequency_and_presence_count_only_completion_tokens():
    logits = torch.zeros(2, 5)
    seqs = [make_seq(prompt=[1, 1, 1, 2], completion=[2, 2, 4], frequency_penalty=1.0),
            make_seq(prompt=[1, 1, 1, 2], completion=[2, 2, 4], presence_penalty=-0.5)]
    out = apply_penalties(logits, seqs)
    assert out[0].tolist() == [0.0, 0.0, -2.0, 0.0, -1.0]
    assert out[1].tolist() == [0.0, 0.0, 0.5, 0.0, 0.5]


def test_repetition_penalty_matches_transformers():
    hf = pytest.importorskip("transformers.generation.logits_process")
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(4, 30, generator=gen) * 3
    ids = torch.randint(0, 30, (4, 12), generator=gen)
    seqs = [make_seq(prompt=row[:7].tolist(), completion=row[7:].tolist(),
                     repetition_penalty=1.3, temperature=0) for row in ids]
    expected = hf.RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone())
    assert torch.allclose(apply_penalties(logits, seqs), expected)
    assert Sampler()(logits, seqs).token_ids == expected.argmax(dim=-1).tolist()


# ---- min_tokens ----------------------------------------------------------------------------

def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    sampler = Sampler(eos_token_ids=[EOS, 9])
    logits = torch.tensor([[10.0, 1.0, 2.0, 3.0, 8.0, 0.0, 0.0, 0.0, 0.0, 9.0]])
    params = dict(min_tokens=3, stop_token_ids=[4], temperature=0)
    assert sampler(logits, [make_seq(completion=[1, 1], **params)]).token_ids == [3]
    assert sampler(logits, [make_seq(completion=[1, 1, 1], **params)]).token_ids == [EOS]
    assert sampler(logits, [make_seq(completion=[1, 1], ignore_eos=True,
                                     **params)]).token_ids == [EOS]
    only_stop = make_seq(completion=[1, 1], ignore_eos=True, min_tokens=3, stop_token_ids=[0])
    assert sampler(logits, [only_stop]).token_ids != [EOS]  # stop ids stay blocked


def test_min_tokens_holds_for_random_rows_and_ignores_ids_past_the_vocab():
    sampler = Sampler(eos_token_ids=[EOS], seed=0)
    seqs = [make_seq(min_tokens=2, stop_token_ids=[1, 500]) for _ in range(300)]
    tokens = sampler(torch.zeros(300, 4), seqs).token_ids
    assert set(tokens) == {2, 3}


# ---- logprobs ------------------------------------------------------------------------------

def test_logprobs_come_from_the_raw_logits():
    logits = torch.tensor([[1.0, 3.0, 2.5, -1.0, 0.0],
                           [1.0, 3.0, 2.5, -1.0, 0.0],
                           [1.0, 3.0, 2.5, -1.0, 0.0],
                           [1.0, 3.0, 2.5, -1.0, 0.0]])
    raw = torch.log_softmax(logits[0], dim=-1).tolist()
    seqs = [make_seq(prompt=[1], temperature=0, repetition_penalty=3.0, logprobs=3),
            make_seq(temperature=0.3, top_k=2, seed=1, logprobs=0),
            make_seq(logprobs=None),
            make_seq(prompt=[1], temperature=0, repetition_penalty=3.0, logprobs=20)]
    out = Sampler(eos_token_ids=[EOS])(logits, seqs)

    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0] == 2  # the penalty pushed token 1 below token 2
    assert first.logprob == pytest.approx(raw[2], abs=1e-6)
    assert first.rank == 2
    assert [t for t, _ in first.top_logprobs] == [1, 2, 0]
    assert [v for _, v in first.top_logprobs] == pytest.approx([raw[1], raw[2], raw[0]], abs=1e-6)

    second = out.logprobs[1]
    assert second.token_id == out.token_ids[1]
    assert second.logprob == pytest.approx(raw[second.token_id], abs=1e-6)
    assert second.rank == 1 + sum(v > raw[second.token_id] for v in raw)
    assert second.top_logprobs == ()
    assert out.logprobs[2] is None
    assert len(out.logprobs[3].top_logprobs) == 5  # capped at the vocabulary size


def test_logprob_rank_counts_strictly_greater_tokens():
    logits = torch.tensor([[2.0, 2.0, 1.0, 1.0]])
    seq = make_seq(prompt=[0, 1], temperature=0, repetition_penalty=10.0, logprobs=4)
    entry = Sampler()(logits, [seq]).logprobs[0]
    assert entry.token_id == 2 and entry.rank == 3
    assert [v for _, v in entry.top_logprobs] == sorted(
        [v for _, v in entry.top_logprobs], reverse=True)
    assert sum(math.exp(v) for _, v in entry.top_logprobs) == pytest.approx(1.0)
