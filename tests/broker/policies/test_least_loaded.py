from broker.policies import make_policy
from tests.broker.policies.snapshots import backend, item, placements, snapshot


def test_picks_fewest_in_flight_and_ties_go_to_first_backend() -> None:
    policy = make_policy("least_loaded")
    backends = [backend("a", 2), backend("b", 1), backend("c", 1)]
    assert placements(policy.decide(snapshot(backends, [item("s1")]))) == [("s1", "b")]


def test_counts_its_own_placements_within_one_call() -> None:
    policy = make_policy("least_loaded")
    backends = [backend("a", 2), backend("b", 0), backend("c", 1)]
    decision = policy.decide(snapshot(backends, [item(f"s{i}") for i in range(5)]))
    # loads (a, b, c): 2,0,1 → b; 2,1,1 tie → b; 2,2,1 → c; 2,2,2 tie → a; 3,2,2 → b
    assert [b for _, b in placements(decision)] == ["b", "b", "c", "a", "b"]


def test_sessions_parked_on_a_tool_are_not_in_flight() -> None:
    policy = make_policy("least_loaded")
    decision = policy.decide(snapshot([backend("b", 1), backend("a", parked=5)], [item("s1")]))
    assert placements(decision) == [("s1", "a")]


def test_skips_unhealthy_backends_even_if_idle() -> None:
    policy = make_policy("least_loaded")
    backends = [backend("a", 0, healthy=False), backend("b", 7)]
    assert placements(policy.decide(snapshot(backends, [item("s1")]))) == [("s1", "b")]
