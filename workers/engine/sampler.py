"""Turns one step's logits into next tokens: stop-token blocking, penalties, greedy or random.

Per row, in this order (rows that share a treatment are handled together with tensor ops):
  0. structured output: tokens the row's grammar does not allow are masked to -inf
     (grammar_mask.py; no work when no row is constrained);
  1. raw logprobs, when the request asks for them (log_softmax of the model's logits);
  2. min_tokens: EOS (unless ignore_eos) and the request's stop ids are masked to -inf;
  3. penalties: repetition (prompt and completion), then frequency and presence (completion);
  4. greedy rows: argmax, ties to the lowest token id;
  5. random rows: temperature, top_k, top_p, min_p, then an exponential race
     (argmax of probs / Exponential(1) noise), which samples exactly from probs.

A seeded request draws its noise from its own generator (``seq.generator``) and always draws
exactly V numbers per step, so its tokens do not depend on the rest of the batch. Unseeded rows
share one sampler-wide generator per device.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from tandem.common.sampling_params import SamplingParams
from tandem.workers.engine.grammar_mask import GrammarMasker
from tandem.workers.engine.host_to_device import as_device_tensor, copies_are_queued
from tandem.workers.engine.sequence import Sequence, TokenLogprob


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprob | None]  # None for rows whose params.logprobs is None


class Sampler:
    def __init__(self, eos_token_ids: Iterable[int] = (), *, seed: int | None = None) -> None:
        """seed fixes the generator shared by unseeded requests (tests); None seeds it randomly."""
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}  # unseeded rows, per device
        self._grammar_masker = GrammarMasker(self.eos_token_ids)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """logits: [B, V], any float dtype; row i belongs to seqs[i]."""
        if not seqs and logits.shape[0] == 0:
            return SamplerOutput([], [])
        return self.sample_on_device(logits, seqs).to_host()

    def sample_on_device(self, logits: torch.Tensor, seqs: list[Sequence], *,
                         placeholders: bool = False) -> DeviceSample:
        """What `__call__` samples, still on the logits' device and with no wait for it: the
        caller reads it later (`DeviceSample.to_host`; asynchronous scheduling reads it once
        the step has run). A constrained row's grammar must have accepted every token before
        the row's input token. placeholders: each row's last token id is already the
        placeholder of the token sampled here (a queued step), so it is not counted among
        the tokens produced before it (min_tokens)."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits of shape {tuple(logits.shape)} do not match "
                             f"{len(seqs)} sequences")
        device = logits.device
        params = [seq.sampling_params for seq in seqs]
        logits = logits.to(torch.float32, copy=True)  # [B, V]; modified in place below
        if any(seq.grammar is not None for seq in seqs):
            self._grammar_masker.apply_(logits, seqs)
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = None
        if logprob_rows:
            raw_logprobs = torch.log_softmax(logits[_index(logprob_rows, device)], dim=-1)
        sampled = self._choose(logits, seqs, 1 if placeholders else 0)
        if raw_logprobs is None:
            return DeviceSample(sampled)
        nums = [params[i].logprobs for i in logprob_rows]
        chosen = sampled[_index(logprob_rows, device)]
        return DeviceSample(sampled, logprob_rows, nums,
                            _logprob_tensors(raw_logprobs, chosen, max(nums)))

    @staticmethod
    def samples_on_device(seq: Sequence) -> bool:
        """Whether a step may sample the sequence before the previous step's tokens are on the
        host: not with penalties (they count the token ids, and the latest may still be in
        flight). A grammar's mask is made on the host from the tokens before the row's input
        token, so its caller samples once those are known."""
        return not _has_penalty(seq.sampling_params)

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence], num_pending: int = 0
                ) -> torch.Tensor:
        """Steps 2-5 on fp32 logits [B, V] (modified in place): the sampled ids, [B] long.
        num_pending: trailing token ids of each row that are this sample's own placeholder."""
        device = logits.device
        self._block_stop_tokens_(logits, seqs, num_pending)
        _apply_penalties_(logits, seqs)
        greedy_rows = [i for i, seq in enumerate(seqs) if seq.sampling_params.is_greedy]
        if len(greedy_rows) == len(seqs):
            return logits.argmax(dim=-1)
        random_rows = [i for i, seq in enumerate(seqs) if not seq.sampling_params.is_greedy]
        if not greedy_rows:
            return self._sample_random(logits, seqs)
        sampled = torch.empty(len(seqs), dtype=torch.long, device=device)  # [B]
        rows = _index(greedy_rows, device)
        sampled[rows] = logits[rows].argmax(dim=-1)
        rows = _index(random_rows, device)
        sampled[rows] = self._sample_random(logits[rows], [seqs[i] for i in random_rows])
        return sampled

    def _block_stop_tokens_(self, logits: torch.Tensor, seqs: list[Sequence],
                            num_pending: int = 0) -> None:
        """Masks stop tokens to -inf in rows that have not yet produced min_tokens tokens
        before the one sampled now (num_pending: its placeholder, already in token_ids)."""
        vocab_size = logits.shape[1]
        rows: list[int] = []
        tokens: list[int] = []
        for i, seq in enumerate(seqs):
            p = seq.sampling_params
            if seq.num_completion_tokens - num_pending >= p.min_tokens:
                continue
            stop_ids = p.stop_token_ids if p.ignore_eos else self.eos_token_ids + p.stop_token_ids
            for token in stop_ids:
                if token < vocab_size:  # ids past the vocabulary can never be sampled anyway
                    rows.append(i)
                    tokens.append(token)
        if rows:
            # The value is made on the device: a Python scalar would be copied there from
            # pageable memory, which waits for every queued kernel (host_to_device.py).
            device = logits.device
            logits.index_put_((_index(rows, device), _index(tokens, device)),
                              torch.full((len(rows),), -math.inf, device=device))

    def _sample_random(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits: [R, V] fp32, modified in place. Returns the sampled ids, [R] long."""
        device = logits.device
        params = [seq.sampling_params for seq in seqs]
        vocab_size = logits.shape[1]
        # Shifting by the row max first keeps tiny temperatures from overflowing to +inf.
        temperature = as_device_tensor([p.temperature for p in params], torch.float32, device)
        logits.sub_(logits.amax(dim=-1, keepdim=True)).div_(temperature[:, None])

        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        needs_p = any(p < 1.0 for p in top_p)
        if needs_p or any(k < vocab_size for k in top_k):
            _apply_top_k_top_p_(logits, top_k, top_p if needs_p else None)
        if any(p.min_p > 0 for p in params):
            # prob_i < min_p * prob_max  <=>  logit_i - logit_max < log(min_p)
            log_min_p = as_device_tensor([math.log(p.min_p) if p.min_p > 0 else -math.inf
                                          for p in params], torch.float32, device)
            too_unlikely = logits - logits.amax(dim=-1, keepdim=True) < log_min_p[:, None]
            logits.masked_fill_(too_unlikely, -math.inf)

        probs = torch.softmax(logits, dim=-1)  # [R, V]
        noise = torch.empty_like(probs)  # [R, V], Exponential(1)
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        if len(seeded) < len(seqs):
            generator = self._shared_generator(device)
            if not seeded:
                noise.exponential_(generator=generator)
            else:
                unseeded = _index([i for i, p in enumerate(params) if p.seed is None], device)
                noise[unseeded] = torch.empty((len(unseeded), vocab_size), device=device
                                              ).exponential_(generator=generator)
        for i in seeded:  # exactly V draws per step from the request's own generator
            noise[i].exponential_(generator=_request_generator(seqs[i], device))
        # A zero draw would make 0/0 = NaN for masked tokens, and argmax picks NaN.
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        return probs.div_(noise).argmax(dim=-1)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self.seed is None:
                generator.seed()
            else:
                generator.manual_seed(self.seed)
            self._generators[device] = generator
        return generator


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Returns fp32 logits [B, V] with each row's penalties applied; the input is unchanged.

    Repetition penalty covers every token of seq.token_ids (prompt and completion): positive
    logits are divided by it, others multiplied. Then frequency_penalty * count and
    presence_penalty * (count > 0) are subtracted, counting completion tokens only. A logit
    pushed past the fp32 range stays the largest finite value (+inf would turn the row into
    NaN once shifted by its maximum); -inf (a masked token) stays -inf.
    """
    out = logits.to(torch.float32, copy=True)
    _apply_penalties_(out, seqs)
    return out


def _has_penalty(p: SamplingParams) -> bool:
    return (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
            or p.presence_penalty != 0.0)


def _apply_penalties_(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In-place version of apply_penalties for fp32 logits; no work when no row has penalties."""
    penalized = [i for i, seq in enumerate(seqs) if _has_penalty(seq.sampling_params)]
    if not penalized:
        return
    device = logits.device
    vocab_size = logits.shape[1]
    rows = _index(penalized, device)
    params = [seqs[i].sampling_params for i in penalized]
    sub = logits[rows]  # [R, V] copy
    counts = _count_tokens([seqs[i].completion_token_ids for i in penalized], vocab_size, device)

    if any(p.repetition_penalty != 1.0 for p in params):
        seen = _count_tokens([seqs[i].token_ids if p.repetition_penalty != 1.0 else []
                              for i, p in zip(penalized, params)], vocab_size, device) > 0
        penalty = as_device_tensor([p.repetition_penalty for p in params], torch.float32,
                                   device)[:, None]
        scaled = torch.where(sub > 0, sub / penalty, sub * penalty)
        sub = torch.where(seen, scaled, sub)

    frequency = as_device_tensor([p.frequency_penalty for p in params], torch.float32,
                                 device)[:, None]
    presence = as_device_tensor([p.presence_penalty for p in params], torch.float32,
                                device)[:, None]
    sub -= frequency * counts + presence * (counts > 0).float()
    logits[rows] = sub.clamp_(max=torch.finfo(torch.float32).max)


def _count_tokens(token_lists: list[list[int]], vocab_size: int,
                  device: torch.device) -> torch.Tensor:
    """Per-row occurrence counts, [R, V] fp32, built with one scatter-add."""
    counts = torch.zeros((len(token_lists), vocab_size), dtype=torch.float32, device=device)
    lengths = [len(t) for t in token_lists]
    if sum(lengths):
        # numpy turns the Python ints into one buffer several times faster than torch.tensor.
        flat = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64,
                           count=sum(lengths))
        tokens = as_device_tensor(flat, torch.int64, device)
        rows = as_device_tensor(np.repeat(np.arange(len(token_lists)), lengths), torch.int64,
                                device)
        counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.float32),
                          accumulate=True)
    return counts


def _apply_top_k_top_p_(logits: torch.Tensor, top_k: list[int],
                        top_p: list[float] | None) -> None:
    """Masks tokens outside each row's top_k / nucleus to -inf, in place.

    logits: [R, V]; top_k[r] == V means off; top_p None means no row uses it (1.0 = off).
    Exactly top_k tokens survive (ties broken towards the lower id); the nucleus is the
    smallest set of most likely tokens whose mass reaches top_p, never empty.
    """
    device = logits.device
    vocab_size = logits.shape[1]
    k = as_device_tensor(top_k, torch.int64, device)[:, None]  # [R, 1]
    if top_p is None:  # top_k only: a partial top-k is much cheaper than a full sort
        max_k = max(top_k)
        _, order = logits.topk(max_k, dim=-1)  # [R, max_k]
        drop_sorted = torch.arange(max_k, device=device)[None, :] >= k
        drop = torch.ones_like(logits, dtype=torch.bool).scatter_(1, order, drop_sorted)
        logits.masked_fill_(drop, -math.inf)
        return
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [R, V]
    drop_sorted = torch.arange(vocab_size, device=device)[None, :] >= k
    sorted_logits.masked_fill_(drop_sorted, -math.inf)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # [R, V], mass of the likelier tokens
    # Rows with top_p == 1 get +inf so rounding in the cumulative sum can never cut their tail.
    p = as_device_tensor([v if v < 1.0 else math.inf for v in top_p], torch.float32,
                         device)[:, None]
    drop_sorted |= mass_before >= p
    drop_sorted[:, 0] = False
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
    logits.masked_fill_(drop, -math.inf)


def _logprob_tensors(raw_logprobs: torch.Tensor, chosen: torch.Tensor,
                     max_n: int) -> tuple[torch.Tensor, ...]:
    """On the device: raw_logprobs [L, V], chosen [L] sampled ids -> the chosen ids [L], their
    logprobs [L], their ranks [L] (1 = most likely) and the top max_n logprobs and ids [L, n]
    (n = min(max_n, V), most likely first)."""
    chosen_logprob = raw_logprobs.gather(1, chosen[:, None])  # [L, 1]
    ranks = (raw_logprobs > chosen_logprob).sum(dim=-1) + 1
    values, ids = raw_logprobs.topk(min(max_n, raw_logprobs.shape[1]), dim=-1)
    return chosen, chosen_logprob[:, 0], ranks, values, ids


def _token_logprobs(tensors: tuple[torch.Tensor, ...], nums: list[int]) -> list[TokenLogprob]:
    """`_logprob_tensors`' values (on the host) as one TokenLogprob per row, row r keeping its
    top nums[r] alternatives."""
    chosen, logprobs, ranks, values, ids = (t.tolist() for t in tensors)
    return [
        TokenLogprob(token_id=token, logprob=logprob, rank=rank,
                     # a grammar-masked token (-inf) is no alternative
                     top_logprobs=tuple((i, v) for i, v in zip(ids_row[:n], values_row[:n])
                                        if v != -math.inf))
        for token, logprob, rank, ids_row, values_row, n in zip(
            chosen, logprobs, ranks, ids, values, nums)
    ]


class DeviceSample:
    """One step's samples on the device (and the logprobs asked for), until `to_host`. For a
    step queued ahead (host_to_device.queued_copies) on a GPU, the host copies are queued at
    once, into pinned memory, with an event to wait on: reading them never waits for work
    queued after this step. A synchronous step's `to_host` copies them then."""

    def __init__(self, token_ids: torch.Tensor, logprob_rows: list[int] = (),
                 nums: list[int] = (), logprob_tensors: tuple[torch.Tensor, ...] = ()) -> None:
        self.token_ids = token_ids  # [B] long, on the device
        self._logprob_rows = list(logprob_rows)
        self._nums = list(nums)
        tensors = (token_ids, *logprob_tensors)
        self._ready = None
        if token_ids.is_cuda and copies_are_queued():
            host = []
            for tensor in tensors:
                copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                copy.copy_(tensor, non_blocking=True)
                host.append(copy)
            self._ready = torch.cuda.Event()
            self._ready.record()
            tensors = tuple(host)
        self._values = tensors  # pinned host copies, or (synchronous) the device tensors

    def to_host(self) -> SamplerOutput:
        """The sampled ids and logprobs; waits (without holding the GIL) until the device has
        computed them."""
        if self._ready is not None:
            self._ready.synchronize()
        token_ids = self._values[0].tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(token_ids)
        if self._logprob_rows:
            for row, entry in zip(self._logprob_rows,
                                  _token_logprobs(self._values[1:], self._nums)):
                logprobs[row] = entry
        return SamplerOutput(token_ids, logprobs)


def _request_generator(seq: Sequence, device: torch.device) -> torch.Generator:
    """The request's own generator, created and seeded on its first random draw."""
    if seq.generator is None:
        seq.generator = torch.Generator(device=device)
        seq.generator.manual_seed(seq.sampling_params.seed)
    return seq.generator


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return as_device_tensor(values, torch.long, device)


def advance_request_generator(seq: Sequence, num_steps: int, vocab_size: int,
                              device: torch.device) -> None:
    """Consume the draws num_steps earlier random steps made, so a seeded request continued on
    another worker (after a prefill elsewhere) draws what it would have drawn in one engine."""
    if seq.sampling_params.seed is None or seq.sampling_params.is_greedy:
        return
    generator = _request_generator(seq, device)
    for _ in range(num_steps):
        torch.empty(vocab_size, device=device).exponential_(generator=generator)
