"""Which worker gets a request: `--routing cache-aware` (default), `least-loaded` or
`round-robin`.

cache-aware scores each candidate worker by

    cost = load - cache_weight * hit

where `load` counts requests: this router's live in-flight count on the worker, plus the
requests the worker reported running or waiting at its last GetLoad beyond those that were this
router's own then (other routers' and direct clients'), plus its KV pressure (KV usage above
half, up to one request at full). A reading counts this router's requests once: the live count
already holds them, and a stale reading of them would keep a drained worker avoided until the
next poll. `hit` is the fraction of the prompt's tokens the worker would serve from its prefix
cache, predicted from the router's KVIndex with the workers' own block hash. The
lowest cost wins; among equal costs the worker picked longest ago wins, so workers with equal
load share uniform traffic evenly, whatever subsets of them tie.

The load margin: a worker that holds the whole prompt is preferred over one that holds none of
it only while it has fewer than `cache_weight` more requests (running or waiting) than that
one; a hot prefix therefore never pins all traffic on one worker: once it is `cache_weight`
requests busier than another, the other gets the prefix's requests and soon its blocks too.
The default, 8 requests, keeps closed-loop conversations on their worker under a fair spread
and hands a prefix over once a worker's queue runs ahead by about 8 requests.

Prefill and aggregated (both) workers are scored by the prompt's prefix (what they would not
recompute); decode workers too, since the blocks a decode worker holds are not pulled.

Local prefill (conditional disaggregation): on a split stack a decode worker holds a
conversation's whole history, the replies it computed included, while a prefill worker never
holds a reply. So before the prefill tier is asked, the decode pick is scored as above; when the
decode worker it chooses would leave at most `local_prefill_max_tokens` prompt tokens
uncomputed, that worker prefills the request itself (reason `local_prefill`, counted as the
request's prompt tier) and nothing is pulled. The default, 256 tokens, keeps such a prefill
about one engine step long: on a GPU a chunk of a few hundred tokens is bound by reading the
weights, as a decode step is, so the decode worker's other streams wait about one step for it;
a longer uncached part goes to the prefill tier, which exists to keep long prefills off the
decode workers. 0 turns local prefill off.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.common.block_hash import PromptBlockHashes
from tandem.common.metrics import RouterMetrics
from tandem.router.kv_index import KVEventFeed, KVIndex

ROUTING_POLICIES = ("cache-aware", "least-loaded", "round-robin")
DEFAULT_CACHE_WEIGHT = 8.0
DEFAULT_LOCAL_PREFILL_MAX_TOKENS = 256
# Tiers whose cached prompt tokens Complete.usage.cached_prompt_tokens reports.
_PROMPT_TIERS = ("prefill", "both")


@dataclass
class RoutingNote:
    """What the policy predicted for a request's prompt tier (the prefill or both worker, or
    the decode worker that prefills the request itself)."""

    predicted_cached_tokens: int = 0
    reason: str = ""
    # The prompt's block hashes by block size, each computed when a pick first probes it
    # (every pick of a request, prefill and decode, reuses and extends them).
    prompt_hashes: dict[int, PromptBlockHashes] = field(default_factory=dict)


class RoutingPolicy:
    def __init__(self, policy: str = "cache-aware", cache_weight: float = DEFAULT_CACHE_WEIGHT,
                 metrics: RouterMetrics | None = None,
                 local_prefill_max_tokens: int = DEFAULT_LOCAL_PREFILL_MAX_TOKENS) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy {policy!r} is not one of "
                             f"{', '.join(ROUTING_POLICIES)}")
        if not cache_weight >= 0:
            raise ValueError(f"cache_weight must be >= 0, got {cache_weight}")
        if local_prefill_max_tokens < 0:
            raise ValueError(f"local_prefill_max_tokens must be >= 0, got "
                             f"{local_prefill_max_tokens}")
        self.policy = policy
        self.cache_weight = cache_weight
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.metrics = metrics
        self.index = KVIndex()
        self.feed = KVEventFeed(self.index, metrics)
        self._turn = itertools.count()  # round-robin
        self._picks = itertools.count()
        self._last_picked: dict[str, int] = {}  # address -> the number of its latest pick
        self._reason_counters: dict[tuple[str, str], object] = {}  # (reason, role) -> counter

    def attach(self, pool) -> None:
        """Routes the pool's picks; cache-aware follows every worker's KV events. Call before
        pool.start()."""
        pool.policy = self
        if self.policy == "cache-aware":
            pool.on_added.append(self.feed.follow)

    async def close(self) -> None:
        await self.feed.close()

    def pick(self, candidates: list, prompt_token_ids: Sequence[int] = (),
             note: RoutingNote | None = None):
        """The worker for a request among healthy `candidates` (WorkerEndpoints)."""
        if not candidates:
            return None
        if self.policy == "round-robin":
            return self._decided(candidates[next(self._turn) % len(candidates)], "round_robin",
                                 0, note)
        if self.policy == "least-loaded" or not prompt_token_ids:
            return self._decided(candidates[self._lowest(candidates, _costs(candidates))],
                                 "least_loaded", 0, note)
        scored = self._cache_aware_choice(candidates, prompt_token_ids, note)
        if scored is None:  # nobody holds the prefix
            return self._decided(candidates[self._lowest(candidates, _costs(candidates))],
                                 "least_loaded", 0, note)
        position, cached = scored
        # load_override: a worker holding more of the prompt was too busy.
        reason = "cache_hit" if cached[position] == max(cached) else "load_override"
        return self._decided(candidates[position], reason, cached[position], note)

    def pick_local_prefill(self, candidates: list, prompt_token_ids: Sequence[int],
                           note: RoutingNote | None = None):
        """The decode worker (among healthy `candidates`) that prefills the request itself, or
        None (nothing recorded): cache-aware only, the worker the decode pick would choose, and
        only when its cached prefix leaves at most local_prefill_max_tokens to compute."""
        if (self.policy != "cache-aware" or not self.local_prefill_max_tokens or not candidates
                or not prompt_token_ids):
            return None
        scored = self._cache_aware_choice(candidates, prompt_token_ids, note)
        if scored is None:
            return None
        position, cached = scored
        num_cached = cached[position]
        if not num_cached or len(prompt_token_ids) - num_cached > self.local_prefill_max_tokens:
            return None
        return self._decided(candidates[position], "local_prefill", num_cached, note,
                             is_prompt_tier=True)

    def _cache_aware_choice(self, candidates: list, prompt_token_ids: Sequence[int],
                            note: RoutingNote | None) -> tuple[int, list[int]] | None:
        """The cache-aware pick among `candidates`: (its position, every candidate's predicted
        cached tokens), or None when none holds any of the prompt. Records nothing."""
        cached = self.predicted_cached_tokens(candidates, prompt_token_ids, note)
        if max(cached) == 0:
            return None
        costs = _costs(candidates, cached, self.cache_weight / len(prompt_token_ids))
        return self._lowest(candidates, costs), cached

    def predicted_cached_tokens(self, candidates: list, prompt_token_ids: Sequence[int],
                                note: RoutingNote | None = None) -> list[int]:
        """Per candidate: prompt tokens its prefix cache would serve (as the worker looks up:
        full blocks only, leaving at least one token to compute)."""
        followed = self.index.followed
        keys = [followed.get(worker.address) for worker in candidates]  # (bit, block size)
        alive_by_block_size: dict[int, int] = {}
        for key in keys:
            if key is not None:
                bit, block_size = key
                alive_by_block_size[block_size] = alive_by_block_size.get(block_size, 0) | bit
        tokens_by_bit: dict[int, int] = {}
        for block_size, alive in alive_by_block_size.items():
            hashes = note.prompt_hashes.get(block_size) if note is not None else None
            if hashes is None:
                hashes = PromptBlockHashes(prompt_token_ids, block_size,
                                           max_blocks=(len(prompt_token_ids) - 1) // block_size)
                if note is not None:
                    note.prompt_hashes[block_size] = hashes
            for bit, blocks in self.index.matched_by_bit(hashes, alive).items():
                tokens_by_bit[bit] = blocks * block_size
        if not tokens_by_bit:
            return [0] * len(candidates)
        return [0 if key is None else tokens_by_bit.get(key[0], 0) for key in keys]

    def record_outcome(self, note: RoutingNote, actual_cached_tokens: int) -> None:
        """The prompt worker's reported cached tokens next to the prediction (metrics)."""
        if self.metrics is not None and note.reason:
            self.metrics.routing_predicted_cached_tokens.inc(note.predicted_cached_tokens)
            self.metrics.routing_actual_cached_tokens.inc(actual_cached_tokens)

    def _lowest(self, candidates: list, costs: list[float]) -> int:
        """The position of the lowest-cost candidate; among equal costs, the one picked longest
        ago."""
        best = min(costs)
        last_picked = self._last_picked
        chosen, chosen_pick = 0, None
        for position, cost in enumerate(costs):
            if cost == best:
                picked = last_picked.get(candidates[position].address, -1)
                if chosen_pick is None or picked < chosen_pick:
                    chosen, chosen_pick = position, picked
        return chosen

    def _decided(self, worker, reason: str, predicted_tokens: int, note: RoutingNote | None,
                 is_prompt_tier: bool = False):
        self._last_picked[worker.address] = next(self._picks)
        if self.metrics is not None:
            counter = self._reason_counters.get((reason, worker.role))
            if counter is None:  # labels() validates and looks up its labels on every call
                counter = self._reason_counters[reason, worker.role] = \
                    self.metrics.routing_reasons.labels(reason=reason, role=worker.role)
            counter.inc()
        if note is not None and (is_prompt_tier or worker.role in _PROMPT_TIERS):
            note.predicted_cached_tokens = predicted_tokens
            note.reason = reason
        return worker


def _costs(candidates: list, cached_tokens: Sequence[int] = (), weight: float = 0.0
           ) -> list[float]:
    """Per candidate: its load minus `weight` times its cached prompt tokens (none given: its
    load alone), in one loop rather than a call per worker.

    A worker's load: this router's requests on it (its live count), others' requests there
    (the last GetLoad's running and waiting beyond this router's own at the time), plus the KV
    pressure: KV usage above half counts up to one more request at full. Usage below half (a
    stale reading, often) counts nothing, so idle workers tie and take turns."""
    costs = []
    for position, worker in enumerate(candidates):
        load = worker.load
        cost = worker.num_in_flight
        others = load.num_running + load.num_waiting - worker.in_flight_at_load
        if others > 0:
            cost += others
        kv_usage = load.kv_usage
        if kv_usage > 0.5:
            cost += (kv_usage - 0.5) * 2
        if cached_tokens:
            cost -= weight * cached_tokens[position]
        costs.append(cost)
    return costs


def add_routing_flags(parser) -> None:
    parser.add_argument("--routing", choices=ROUTING_POLICIES, default="cache-aware",
                        help="how the router picks a worker: cache-aware (prefix cache hit "
                             "vs load), least-loaded, round-robin")
    parser.add_argument("--cache-weight", type=float, default=DEFAULT_CACHE_WEIGHT,
                        help="cache-aware: how many more requests (running + waiting) a "
                             "worker holding the whole prompt may have than one holding none "
                             "and still be chosen (default %(default)s)")
    parser.add_argument("--local-prefill-max-tokens", type=int,
                        default=DEFAULT_LOCAL_PREFILL_MAX_TOKENS, metavar="N",
                        help="cache-aware, split stacks: a decode worker holding all but at "
                             "most N tokens of a prompt prefills it itself, and nothing is "
                             "pulled (a conversation's next turn: the decode worker holds the "
                             "replies, the prefill tier does not). The default keeps such a "
                             "prefill about one step long, which is what the decode worker's "
                             "other streams wait for it; 0 turns it off (default "
                             "%(default)s)")
