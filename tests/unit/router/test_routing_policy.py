"""The router's KV index and routing policies, on plain worker records (no processes)."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry

from tandem.common.block_hash import PromptBlockHashes, prefix_block_hashes
from tandem.common.metrics import RouterMetrics
from tandem.router.kv_index import KVIndex
from tandem.router.routing_policy import RoutingNote, RoutingPolicy
from tandem.v1 import worker_pb2

BLOCK = 4


@dataclass(eq=False)
class Worker:
    address: str
    role: str = "both"
    num_in_flight: int = 0
    in_flight_at_load: int = 0
    load: worker_pb2.GetLoadResponse = field(default_factory=worker_pb2.GetLoadResponse)


def snapshot(hashes, block_size=BLOCK):
    return worker_pb2.SubscribeKVEventsResponse(is_snapshot=True, block_size=block_size,
                                                stored_hashes=hashes)


def hold(policy: RoutingPolicy, worker: Worker, token_ids) -> None:
    policy.index.apply(worker.address, snapshot(prefix_block_hashes(token_ids, BLOCK)))


PROMPT = list(range(100, 141))  # 41 tokens: 10 blocks to look up


def lookup(token_ids) -> PromptBlockHashes:
    """The prompt's blocks a worker looks up: all full blocks but a last token to compute."""
    return PromptBlockHashes(token_ids, BLOCK, max_blocks=(len(token_ids) - 1) // BLOCK)


def test_index_matches_leading_blocks_per_worker():
    index = KVIndex()
    hashes = prefix_block_hashes(PROMPT, BLOCK)
    index.apply("a", snapshot(hashes[:3]))
    index.apply("b", snapshot(hashes[:7] + [123]))
    index.apply("c", snapshot(hashes[1:]))  # no first block: nothing usable
    assert index.matched_blocks(lookup(PROMPT), ["a", "b", "c", "d"]) == {
        "a": 3, "b": 7, "c": 0, "d": 0}
    index.apply("b", worker_pb2.SubscribeKVEventsResponse(block_size=BLOCK,
                                                          evicted_hashes=[hashes[2]]))
    assert index.matched_blocks(lookup(PROMPT), ["a", "b"]) == {"a": 3, "b": 2}
    index.apply("a", snapshot([]))  # a fresh snapshot replaces what was known
    assert index.num_blocks("a") == 0
    index.forget("b")
    index.forget("c")
    assert index.num_hashes == 0 and index.block_sizes == {"a": BLOCK}


@pytest.mark.parametrize("seed", range(20))
def test_index_matches_each_workers_prefix_as_a_walk_over_every_block_would(seed):
    rng = random.Random(seed)
    prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 300))]
    hashes = prefix_block_hashes(prompt, BLOCK)
    index, expected, with_hole = KVIndex(), {}, set()
    for address in "abcdefgh":
        count = rng.choice([0, len(hashes), rng.randrange(len(hashes) + 1)])
        held = hashes[:count]
        if held and rng.random() < 0.3:  # a hole: the worker serves the blocks before it
            hole = rng.randrange(len(held))
            held, count = held[:hole] + held[hole + 1:], hole
            with_hole.add(address)
        index.apply(address, snapshot(held + [rng.getrandbits(64)]))
        expected[address] = min(count, (len(prompt) - 1) // BLOCK)
    matched = index.matched_blocks(lookup(prompt), list("abcdefgh"))
    for address, count in matched.items():
        if address in with_hole:
            assert count >= expected[address]  # a hole no probe lands on goes unseen
        else:
            assert count == expected[address]


def test_index_matching_probes_few_blocks():
    index = KVIndex()
    prompt = list(range(1000, 1401))  # 100 blocks to look up
    hashes = prefix_block_hashes(prompt, BLOCK)
    index.apply("whole", snapshot(hashes))
    probes = lookup(prompt)
    assert index.matched_blocks(probes, ["whole"]) == {"whole": 100}
    assert sorted(probes.probed) == [1, 100]  # the first block and the last
    for address, count in (("a", 3), ("b", 40), ("c", 41), ("d", 77)):
        index.apply(address, snapshot(hashes[:count]))
    probes = lookup(prompt)
    assert index.matched_blocks(probes, ["whole", "a", "b", "c", "d"]) == {
        "whole": 100, "a": 3, "b": 40, "c": 41, "d": 77}
    assert len(probes.probed) <= 4 * 7 + 2  # log2(100) rounded up, per distinct count


def test_matching_hashes_only_the_blocks_it_probes():
    policy = RoutingPolicy("cache-aware")
    workers = [Worker("a"), Worker("b")]
    long_prompt = list(range(1000, 1401))  # 100 blocks to look up
    hold(policy, workers[0], long_prompt[:12])  # its first 3 blocks
    note = RoutingNote()
    assert policy.pick(workers, long_prompt, note) is workers[0]
    assert note.predicted_cached_tokens == 12
    hashes = note.prompt_hashes[BLOCK]
    assert len(hashes) == 100 and len(hashes.probed) <= 9
    hold(policy, workers[1], long_prompt)  # the decode tier's pick probes on from there
    assert policy.predicted_cached_tokens(workers, long_prompt, note) == [12, 400]
    expected = prefix_block_hashes(long_prompt, BLOCK)
    assert all(hashes.hash_of(count) == expected[count - 1] for count in hashes.probed)


def test_cleared_drops_everything_before_its_stored_hashes():
    index = KVIndex()
    hashes = prefix_block_hashes(PROMPT, BLOCK)
    index.apply("a", snapshot(hashes[:3]))
    index.apply("a", worker_pb2.SubscribeKVEventsResponse(block_size=BLOCK, cleared=True,
                                                          stored_hashes=hashes[:1]))
    assert index.num_blocks("a") == 1
    assert index.matched_blocks(lookup(PROMPT), ["a"]) == {"a": 1}


def test_cache_aware_sends_a_prompt_where_its_prefix_is():
    policy = RoutingPolicy("cache-aware", cache_weight=8)
    workers = [Worker("a"), Worker("b"), Worker("c")]
    hold(policy, workers[1], PROMPT[:20])
    hold(policy, workers[2], PROMPT)
    note = RoutingNote()
    assert policy.pick(workers, PROMPT, note) is workers[2]
    assert note.predicted_cached_tokens == 40 and note.reason == "cache_hit"
    workers[2].num_in_flight = 2  # busier, but it saves 20 more tokens than b
    assert policy.pick(workers, PROMPT) is workers[2]


def test_a_hot_prefix_yields_to_load_past_the_margin():
    policy = RoutingPolicy("cache-aware", cache_weight=8)
    hot, idle = Worker("hot", num_in_flight=9), Worker("idle")
    hold(policy, hot, PROMPT)
    note = RoutingNote()
    assert policy.pick([hot, idle], PROMPT, note) is idle
    assert note.reason == "load_override" and note.predicted_cached_tokens == 0


def test_prediction_leaves_one_token_to_compute():
    policy = RoutingPolicy("cache-aware")
    worker = Worker("a")
    hold(policy, worker, PROMPT[:40])  # the whole 40-token prompt, 10 full blocks
    note = RoutingNote()
    policy.pick([worker, Worker("b")], PROMPT[:40], note)
    assert note.predicted_cached_tokens == 36  # as the worker looks up: (40 - 1) // 4 blocks


@pytest.mark.parametrize("name", ["cache-aware", "least-loaded", "round-robin"])
def test_equal_workers_take_turns(name):
    policy = RoutingPolicy(name)
    workers = [Worker("a"), Worker("b"), Worker("c")]
    picks = [policy.pick(workers, [i] * 9).address for i in range(30)]
    assert sorted(picks.count(a) for a in "abc") == [10, 10, 10]


@pytest.mark.parametrize("name", ["cache-aware", "least-loaded"])
def test_workers_tied_in_changing_subsets_still_share_evenly(name):
    # Requests arrive in pairs and each pair finishes before the next: the first pick of a
    # pair ties all three workers, the second ties the two left.
    policy = RoutingPolicy(name)
    workers = [Worker("a"), Worker("b"), Worker("c")]
    picks = []
    for pair in range(30):
        for _ in range(2):
            worker = policy.pick(workers, [pair] * 9)
            worker.num_in_flight += 1
            picks.append(worker.address)
        for worker in workers:
            worker.num_in_flight = 0
    assert sorted(picks.count(a) for a in "abc") == [20, 20, 20]


@pytest.mark.parametrize("name", ["cache-aware", "least-loaded"])
def test_a_reported_queue_of_this_routers_own_requests_counts_once(name):
    # Both workers have 3 of this router's requests; a's last GetLoad saw them (1 running, 2
    # waiting), b's saw none yet. They are equally loaded.
    policy = RoutingPolicy(name)
    a = Worker("a", num_in_flight=3, in_flight_at_load=3,
               load=worker_pb2.GetLoadResponse(num_running=1, num_waiting=2))
    b = Worker("b", num_in_flight=3)
    picks = [policy.pick([a, b], [i] * 9).address for i in range(4)]
    assert sorted(picks) == ["a", "a", "b", "b"]


def test_other_routers_requests_count_as_load():
    # a runs 4 requests of which none is this router's; b has 2 of this router's.
    policy = RoutingPolicy("least-loaded")
    a = Worker("a", load=worker_pb2.GetLoadResponse(num_running=3, num_waiting=1))
    b = Worker("b", num_in_flight=2, in_flight_at_load=2,
               load=worker_pb2.GetLoadResponse(num_running=2))
    assert policy.pick([a, b]) is b


def test_round_robin_cycles_through_two_workers():
    policy = RoutingPolicy("round-robin")
    workers = [Worker("a"), Worker("b")]
    assert [policy.pick(workers).address for _ in range(4)] == ["a", "b", "a", "b"]


def test_kv_usage_counts_only_above_half():
    policy = RoutingPolicy("least-loaded")
    low, high, other = Worker("low"), Worker("high"), Worker("other")
    low.load.kv_usage, high.load.kv_usage = 0.3, 0.95
    picks = [policy.pick([low, high, other]).address for _ in range(4)]
    assert sorted(picks) == ["low", "low", "other", "other"]


def test_least_loaded_ignores_the_cache():
    policy = RoutingPolicy("least-loaded")
    holder, other = Worker("holder", num_in_flight=1), Worker("other")
    hold(policy, holder, PROMPT)
    assert policy.pick([holder, other], PROMPT) is other


def test_decisions_are_counted_by_reason_and_role():
    metrics = RouterMetrics("m", CollectorRegistry())
    policy = RoutingPolicy("cache-aware", metrics=metrics)
    prefill, decode = Worker("p", role="prefill"), Worker("d", role="decode")
    busy = Worker("busy", role="prefill", num_in_flight=20)
    hold(policy, busy, PROMPT)
    for _ in range(2):
        assert policy.pick([prefill, busy], PROMPT) is prefill  # busy holds it, too busy
        assert policy.pick([decode], PROMPT) is decode  # nobody holds it there
    busy.num_in_flight = 0
    assert policy.pick([prefill, busy], PROMPT) is busy
    assert policy.pick([prefill]) is prefill  # no prompt: least loaded
    RoutingPolicy("round-robin", metrics=metrics).pick([decode])

    def count(reason, role):
        return metrics.registry.get_sample_value(
            "tandem:routing_reasons_total", {"model": "m", "tier": "router", "reason": reason,
                                             "role": role}) or 0

    assert count("load_override", "prefill") == 2 and count("least_loaded", "decode") == 2
    assert count("cache_hit", "prefill") == 1 and count("round_robin", "decode") == 1
    assert count("least_loaded", "prefill") == 1 and count("cache_hit", "decode") == 0


def test_a_decode_worker_holding_all_but_a_few_tokens_prefills_locally():
    metrics = RouterMetrics("m", CollectorRegistry())
    policy = RoutingPolicy("cache-aware", metrics=metrics, local_prefill_max_tokens=8)
    holder, other = Worker("holder", role="decode"), Worker("other", role="decode")
    hold(policy, holder, PROMPT[:36])  # 9 of the 10 blocks to look up: 5 tokens to compute
    note = RoutingNote()
    assert policy.pick_local_prefill([holder, other], PROMPT, note) is holder
    # The decode worker is the prompt tier: its cached tokens are the request's.
    assert note.reason == "local_prefill" and note.predicted_cached_tokens == 36
    assert metrics.registry.get_sample_value(
        "tandem:routing_reasons_total", {"model": "m", "tier": "router",
                                         "reason": "local_prefill", "role": "decode"}) == 1
    longer = PROMPT + list(range(500, 504))  # 9 tokens to compute: the prefill tier's
    assert policy.pick_local_prefill([holder, other], longer, RoutingNote()) is None
    holder.num_in_flight = 9  # the decode pick would take the other: no local prefill
    assert policy.pick_local_prefill([holder, other], PROMPT, RoutingNote()) is None


@pytest.mark.parametrize("policy", [RoutingPolicy("least-loaded"), RoutingPolicy("round-robin"),
                                    RoutingPolicy("cache-aware", local_prefill_max_tokens=0)])
def test_local_prefill_needs_the_index_and_a_limit(policy):
    holder = Worker("holder", role="decode")
    hold(policy, holder, PROMPT)
    assert policy.pick_local_prefill([holder], PROMPT, RoutingNote()) is None


def test_nobody_holding_the_prompt_means_no_local_prefill():
    policy = RoutingPolicy("cache-aware")
    assert policy.pick_local_prefill([Worker("d", role="decode")], PROMPT[:5]) is None


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="not one of"):
        RoutingPolicy("random")
    with pytest.raises(ValueError, match="cache_weight"):
        RoutingPolicy(cache_weight=-1)
    with pytest.raises(ValueError, match="local_prefill_max_tokens"):
        RoutingPolicy(local_prefill_max_tokens=-1)
