"""The vLLM Router 0.1.17 cache_aware rule (src/policies/cache_aware.rs, select_prepared)."""

import pytest

from broker.policies import make_policy
from broker.policies.cache_aware import DEFAULT_MAX_TREE_SIZE, CacheAware, cache_aware_grid
from tests.broker.policies.snapshots import backend, item, placements, snapshot

P = tuple(range(100, 110))  # a 10-token prompt


def route(policy, backends, *items, now: float = 0.0) -> list[str]:
    return [b for _, b in placements(policy.decide(snapshot(backends, list(items), now=now)))]


def primed(**params) -> CacheAware:
    """A policy whose tree says backend `a` has served P."""
    policy = make_policy("cache_aware", **params)
    assert route(policy, [backend("a"), backend("b")], item("prime", P)) == ["a"]
    return policy


def test_defaults_are_the_routers() -> None:
    policy = make_policy("cache_aware")
    assert (policy.cache_threshold, policy.balance_abs_threshold) == (0.3, 64)
    assert policy.balance_rel_threshold == 1.5
    assert DEFAULT_MAX_TREE_SIZE == 2**22  # 2**25 chars at 8 hex chars per token
    assert policy.dispatch_on_arrival


def test_match_above_threshold_goes_to_the_matching_backend_though_busier() -> None:
    policy = primed()
    request = item("s", P[:8] + (1, 2))  # 8 of 10 tokens match a: 0.8 > 0.3
    assert route(policy, [backend("a", 5), backend("b", 0)], request) == ["a"]


def test_match_below_threshold_goes_to_least_loaded_not_smallest_tree() -> None:
    policy = primed()
    # b now holds far more tokens than a, so "smallest tree" would pick a; the source picks
    # the least loaded backend.
    big = item("big", tuple(range(900, 1000)))
    assert route(policy, [backend("a", 0), backend("b", 1)], big) == ["a"]
    request = item("s", P[:2] + tuple(range(1, 9)))  # 0.2 ≤ 0.3
    assert route(policy, [backend("a", 2), backend("b", 1)], request) == ["b"]


def test_threshold_is_strict() -> None:
    policy = primed(cache_threshold=0.5)  # exact in f32
    request = item("s", P[:5] + tuple(range(1, 6)))  # exactly 0.5
    assert route(policy, [backend("a", 2), backend("b", 1)], request) == ["b"]
    request = item("t", P[:6] + tuple(range(1, 5)))  # 0.6
    assert route(policy, [backend("a", 2), backend("b", 1)], request) == ["a"]


def test_threshold_compares_as_the_routers_f32() -> None:
    # f32(0.7) = 0.69999998…, so a 7/10 match clears it in the router; a float64 0.7 would not.
    policy = primed(cache_threshold=0.7)
    request = item("s", P[:7] + (1, 2, 3))
    assert route(policy, [backend("a", 2), backend("b", 1)], request) == ["a"]


def test_best_matches_tie_goes_to_the_least_loaded_of_them() -> None:
    policy = primed()
    route(policy, [backend("a", 1), backend("b", 0)], item("copy", P))  # full match: a
    policy.tree.insert(P, "b")  # b has served P too
    backends = [backend("c", 0), backend("a", 5), backend("b", 2)]
    assert route(policy, backends, item("s", P)) == ["b"]


@pytest.mark.parametrize(
    ("load_a", "load_b", "expected"),
    [
        (100, 10, "b"),  # diff 90 > 64 and 100 > 15: imbalanced → least loaded
        (300, 220, "a"),  # diff 80 > 64 but 300 ≤ 330: balanced → cache
        (30, 10, "a"),  # 30 > 15 but diff 20 ≤ 64: balanced → cache
        (74, 10, "a"),  # diff exactly 64: not > 64
        (75, 10, "b"),
        (300, 200, "a"),  # 300 is not > 1.5 × 200
        (301, 200, "b"),
    ],
)
def test_imbalance_needs_both_conditions(load_a: int, load_b: int, expected: str) -> None:
    policy = primed()
    assert route(policy, [backend("a", load_a), backend("b", load_b)], item("s", P)) == [expected]


def test_imbalance_counts_this_calls_placements_and_still_teaches_the_tree() -> None:
    policy = make_policy("cache_aware")
    group = [item(f"g{i}", P) for i in range(67)]  # a GRPO-like burst with one prompt
    chosen = route(policy, [backend("a"), backend("b")], *group)
    # a takes the first 65 (its load reaches 65 > 0 + 64), then the fleet is imbalanced.
    assert chosen[:65] == ["a"] * 65
    assert chosen[65] == "b"
    assert policy.tree.match_lengths(P)["b"] == len(P)  # learned even when load-balancing
    assert chosen[66] == "b"  # both match fully now; b is the less loaded of the two


def test_follow_up_turns_land_on_the_backend_holding_their_history() -> None:
    policy = make_policy("cache_aware")
    fleet = [backend("a", 3), backend("b", 0), backend("c", 1)]
    (home,) = route(policy, fleet, item("x", P))
    assert home == "b"
    busy_home = [backend("a", 0), backend("b", 4), backend("c", 0)]
    history = P
    for turn in (1, 2, 3):
        history = history + tuple(range(100 * turn, 100 * turn + 4))  # output + observation
        follow_up = item("x", history, turn=turn, home_backend="b", enqueued_at=float(turn))
        assert route(policy, busy_home, follow_up, now=float(turn)) == ["b"]


def test_a_follow_up_mostly_new_to_the_router_goes_by_load() -> None:
    # The router has seen only the earlier prompt, not the output: 10 of 50 tokens is 0.2.
    policy = make_policy("cache_aware")
    route(policy, [backend("a"), backend("b", 1)], item("x", P))
    follow_up = item("x", P + tuple(range(500, 540)), turn=1, home_backend="a")
    assert route(policy, [backend("a", 4), backend("b", 0)], follow_up) == ["b"]


def test_lru_eviction_runs_each_interval_and_drops_the_oldest_prefix() -> None:
    policy = make_policy("cache_aware", max_tree_size=10, eviction_interval_s=60.0)
    old, new = tuple(range(10)), tuple(range(50, 60))
    fleet = [backend("a"), backend("b")]
    assert route(policy, fleet, item("old", old), now=0.0) == ["a"]
    assert route(policy, fleet, item("new", new), now=10.0) == ["a"]  # a holds 20 > 10
    route(policy, fleet, now=59.0)
    assert policy.tree.match_lengths(old)["a"] == 10  # not yet: the first pass is at t = 60
    # At t ≥ 60 the pass runs before routing: old (least recently routed) goes, new stays.
    assert route(policy, [backend("a", 1), backend("b")], item("o2", old), now=61.0) == ["b"]
    assert policy.tree.match_lengths(new)["a"] == 10
    assert policy.tree.size["a"] == 10
    policy.tree.check()


def test_routing_a_prefix_again_makes_it_recent() -> None:
    policy = make_policy("cache_aware", max_tree_size=10, eviction_interval_s=60.0)
    old, new = tuple(range(10)), tuple(range(50, 60))
    fleet = [backend("a"), backend("b", 1)]
    route(policy, fleet, item("old", old), now=0.0)
    route(policy, fleet, item("new", new), now=10.0)
    assert route(policy, fleet, item("again", old), now=20.0) == ["a"]
    route(policy, fleet, now=60.0)
    assert policy.tree.match_lengths(old)["a"] == 10
    assert policy.tree.match_lengths(new)["a"] == 0


def test_zero_interval_never_evicts() -> None:
    policy = make_policy("cache_aware", max_tree_size=1, eviction_interval_s=0)
    route(policy, [backend("a")], item("s", P), now=0.0)
    route(policy, [backend("a")], item("t", (1,)), now=1e6)
    assert policy.tree.match_lengths(P)["a"] == len(P)


def test_backends_that_leave_the_snapshot_are_forgotten() -> None:
    policy = primed()
    route(policy, [backend("b")], item("s", (7, 7)))  # a is gone
    assert "a" not in policy.tree.tenants()
    assert route(policy, [backend("a", 1), backend("b", 0)], item("t", P)) == ["b"]


def test_unhealthy_backends_are_skipped_but_remembered() -> None:
    policy = primed()
    assert route(policy, [backend("a", healthy=False), backend("b", 3)], item("s", P)) == ["b"]
    assert policy.tree.match_lengths(P)["a"] == len(P)
    assert route(policy, [backend("a", healthy=False)], item("t", P)) == []


def test_empty_prefix_goes_to_least_loaded_and_is_not_learned() -> None:
    policy = make_policy("cache_aware")
    assert route(policy, [backend("a", 2), backend("b", 1)], item("s", ())) == ["b"]
    assert policy.tree.tenants() == []


def test_grid_covers_the_three_thresholds_and_builds() -> None:
    grid = cache_aware_grid()
    assert len(grid) == 36
    default = {"cache_threshold": 0.3, "balance_abs_threshold": 64, "balance_rel_threshold": 1.5}
    assert default in grid
    assert {p["cache_threshold"] for p in grid} == {0.1, 0.3, 0.5, 0.7}
    assert {p["balance_abs_threshold"] for p in grid} == {16, 64, 256}
    assert {p["balance_rel_threshold"] for p in grid} == {1.2, 1.5, 2.0}
    for params in grid:
        assert isinstance(make_policy("cache_aware", **params), CacheAware)


def test_rejects_a_threshold_outside_zero_one() -> None:
    with pytest.raises(ValueError, match="cache_threshold"):
        make_policy("cache_aware", cache_threshold=1.5)
