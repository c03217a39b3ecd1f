from broker.policies import make_policy
from broker.policies.base import default_reservation
from tests.broker.policies.snapshots import backend, item, placements, snapshot


def test_cycles_over_backends_in_snapshot_order_across_calls() -> None:
    policy = make_policy("round_robin")
    backends = [backend("a"), backend("b", in_flight=9), backend("c")]
    first = policy.decide(snapshot(backends, [item("s1"), item("s2")]))
    second = policy.decide(snapshot(backends, [item("s3"), item("s4")]))
    assert placements(first) + placements(second) == [
        ("s1", "a"),
        ("s2", "b"),
        ("s3", "c"),
        ("s4", "a"),
    ]


def test_skips_unhealthy_backends() -> None:
    policy = make_policy("round_robin")
    backends = [backend("a"), backend("b", healthy=False), backend("c")]
    decision = policy.decide(snapshot(backends, [item(f"s{i}") for i in range(4)]))
    assert [b for _, b in placements(decision)] == ["a", "c", "a", "c"]


def test_no_healthy_backend_admits_nothing() -> None:
    policy = make_policy("round_robin")
    decision = policy.decide(snapshot([backend("a", healthy=False)], [item("s1")]))
    assert decision.admissions == []


def test_reserves_prompt_plus_cap_and_dispatches_on_arrival() -> None:
    policy = make_policy("round_robin")
    pending = item("s1", (1, 2, 3))
    (admission,) = policy.decide(snapshot([backend("a")], [pending])).admissions
    assert admission.reserved_tokens == default_reservation(pending) == 103
    assert policy.dispatch_on_arrival
