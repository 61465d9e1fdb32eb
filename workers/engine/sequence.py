"""A request inside the engine: its tokens, its KV blocks, and where it is in its life."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass

from tandem.common.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV blocks
    RUNNING = "running"  # holds KV blocks; prefilling (maybe in chunks) or decoding
    FINISHED = "finished"  # done; its blocks have been freed
    PINNED = "pinned"  # prefill done; blocks kept (outside the scheduler) for a decode worker
    RECEIVING = "receiving"  # blocks allocated (outside the scheduler); KV arriving from a peer
    # prefilled elsewhere: queued (outside scheduling, no blocks) until blocks are free to
    # receive its KV into, then RECEIVING
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS id or a stop token id was sampled, or the output grammar completed
    LENGTH = "length"  # max_tokens reached, or the sequence filled max_model_len
    ABORT = "abort"  # cancelled by the caller


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The log-probability of one generated token and the top-N alternatives at its position."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_logprobs: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


_seq_ids = itertools.count()
# Stands for a token still being sampled on the device; never a real id (ids are >= 0).
PLACEHOLDER_TOKEN_ID = -1


class Sequence:
    """Token ids (prompt then completion), the block table, and progress counters.

    Invariants kept by the scheduler and the block manager:
      0 <= num_cached_tokens <= num_computed_tokens <= num_tokens
      len(block_table) * block_size >= num_computed_tokens while RUNNING;
      block_table == [] otherwise
      a decoding sequence has num_computed_tokens == num_tokens - 1 (the last sampled token's KV
      is written by the next step).

    Under asynchronous scheduling (engine.py) a token can be in flight: its step has been
    launched on the device and its value is not known on the host yet. Such a token is held by
    a placeholder (PLACEHOLDER_TOKEN_ID) at the end of token_ids, so counts and block tables
    already include it; num_inflight_tokens says how many trailing ids are placeholders, and
    the `known` accessors skip them.
    """

    __slots__ = (
        "seq_id", "request_id", "token_ids", "num_prompt_tokens", "sampling_params", "status",
        "block_table", "block_hashes", "num_computed_tokens", "num_cached_tokens",
        "finish_reason", "logprobs", "generator", "num_preemptions", "num_prefix_hit_tokens",
        "pin_after_prefill", "deadline", "grammar", "num_inflight_tokens",
        "arrival_time", "first_scheduled_time", "first_token_time", "finished_time",
    )

    def __init__(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 request_id: str | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        self.seq_id = next(_seq_ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        # Hashes of this sequence's full blocks whose KV is computed, in order; owned by
        # the block manager (prefix caching), reset whenever the blocks are freed.
        self.block_hashes: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is in the cache (prefix hits included)
        self.num_cached_tokens = 0  # of those, tokens found in the prefix cache at allocation
        self.finish_reason: FinishReason | None = None
        self.logprobs: list[TokenLogprob] = []  # one per completion token when asked for
        self.generator = None  # the sampler's per-request torch.Generator, for seeded requests
        self.num_preemptions = 0
        # Prompt tokens served from the prefix cache at the latest admission (kept after free).
        self.num_prefix_hit_tokens = 0
        # Prefill-worker requests: after the first token, keep the blocks for a decode worker.
        self.pin_after_prefill = False
        # time.monotonic() after which nobody waits for the request: the engine drops it
        # between steps (None: no deadline).
        self.deadline: float | None = None
        # Constrained requests (structured_output): the grammar every sampled token must fit.
        self.grammar = None  # grammar_mask.RequestGrammar | None
        self.num_inflight_tokens = 0  # trailing placeholders in token_ids (see the docstring)
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, status={self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are known on the host (the in-flight placeholders excluded)."""
        return len(self.token_ids) - self.num_inflight_tokens

    @property
    def last_known_token_id(self) -> int:
        return self.token_ids[len(self.token_ids) - self.num_inflight_tokens - 1]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def num_blocks(self, block_size: int) -> int:
        """Blocks needed to hold the KV of every token of the sequence."""
        return (len(self.token_ids) + block_size - 1) // block_size

    def block_token_ids(self, index: int, block_size: int) -> list[int]:
        return self.token_ids[index * block_size: (index + 1) * block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def append_placeholder(self) -> int:
        """Holds the place of a token being sampled on the device; returns its index."""
        self.token_ids.append(PLACEHOLDER_TOKEN_ID)
        self.num_inflight_tokens += 1
        return len(self.token_ids) - 1

    def fill_placeholder(self, index: int, token_id: int) -> None:
        """The in-flight token at index (the oldest one) has arrived on the host."""
        assert self.token_ids[index] == PLACEHOLDER_TOKEN_ID, f"{self}: no placeholder at {index}"
        self.token_ids[index] = token_id
        self.num_inflight_tokens -= 1

    def drop_placeholders(self) -> None:
        """Forget the in-flight tokens (the sequence ended before they arrived)."""
        if self.num_inflight_tokens:
            del self.token_ids[len(self.token_ids) - self.num_inflight_tokens:]
            self.num_inflight_tokens = 0
