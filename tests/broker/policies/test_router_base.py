"""What all four router baselines share: every pending item placed once, on a healthy backend."""

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.policies import make_policy, policy_names
from broker.policies.router_base import arrival_order
from tests.broker.policies.snapshots import backend, item, placements, snapshot

ROUTERS = ("round_robin", "least_loaded", "power_of_two", "cache_aware")


def test_all_four_are_registered_routers() -> None:
    assert set(ROUTERS) <= set(policy_names())
    assert all(make_policy(name).dispatch_on_arrival for name in ROUTERS)


def test_oldest_first_across_workloads_and_stable_within_one() -> None:
    pending = {
        "rlvr": (
            item("v1", workload="rlvr", enqueued_at=2.0),
            item("v2", workload="rlvr", enqueued_at=2.0),
        ),
        "agentic": (
            item("g1", workload="agentic", enqueued_at=1.0),
            item("g2", workload="agentic", enqueued_at=3.0),
        ),
        "rlhf": (item("h1", enqueued_at=2.0),),
    }
    assert [i.session_id for i in arrival_order(pending)] == ["g1", "h1", "v1", "v2", "g2"]


def test_admissions_come_in_arrival_order() -> None:
    items = [item("late", enqueued_at=9.0), item("early", workload="rlvr", enqueued_at=1.0)]
    for name in ROUTERS:
        decision = make_policy(name).decide(snapshot([backend("a"), backend("b")], items))
        assert [s for s, _ in placements(decision)] == ["early", "late"], name


fleets = st.lists(
    st.tuples(st.integers(0, 80), st.booleans()), min_size=1, max_size=6
).map(lambda specs: [backend(f"b{i}", load, healthy=ok) for i, (load, ok) in enumerate(specs)])
pendings = st.lists(
    st.tuples(
        st.sampled_from(["rlvr", "rlhf", "agentic"]),
        st.floats(0, 10, allow_nan=False),
        st.lists(st.integers(0, 3), max_size=8).map(tuple),
    ),
    max_size=40,
).map(
    lambda specs: [
        item(f"s{i}", prefix, workload=w, enqueued_at=t) for i, (w, t, prefix) in enumerate(specs)
    ]
)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(ROUTERS), fleets, pendings, st.integers(0, 3))
def test_every_item_placed_exactly_once_on_a_healthy_backend(name, fleet, items, rounds) -> None:
    policy = make_policy(name)
    healthy = {b.backend_id for b in fleet if b.healthy}
    for r in range(rounds + 1):  # state carried across calls must not break the contract
        decision = policy.decide(snapshot(fleet, items, now=float(r)))
        placed = placements(decision)
        if not healthy:
            assert placed == []
            continue
        assert sorted(s for s, _ in placed) == sorted(i.session_id for i in items)
        assert all(b in healthy for _, b in placed)


@settings(max_examples=50, deadline=None)
@given(fleets, pendings)
def test_least_loaded_places_each_item_on_a_currently_least_loaded_backend(fleet, items) -> None:
    healthy = [b for b in fleet if b.healthy]
    decision = make_policy("least_loaded").decide(snapshot(fleet, items))
    load = {b.backend_id: b.in_flight for b in healthy}
    for _, b in placements(decision):
        assert load[b] == min(load.values())
        load[b] += 1


def _with_progress(fleet, seed: int):
    """The same fleet with every resident session's heartbeat progress changed."""
    def moved(s, k):
        return dataclasses.replace(s, context_tokens=s.context_tokens + 7 * k + seed,
                                   generated_tokens=s.generated_tokens + 3 * k + seed,
                                   turn=s.turn + seed)
    return [dataclasses.replace(b, sessions=tuple(moved(s, k) for k, s in enumerate(b.sessions)))
            for b in fleet]


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(ROUTERS), fleets, pendings, st.integers(1, 500))
def test_routers_do_not_read_heartbeat_progress(name, fleet, items, seed) -> None:
    """`reads_progress = False` lets drivers skip refreshing progress: it must not matter."""
    assert not make_policy(name).reads_progress
    a = make_policy(name).decide(snapshot(fleet, items))
    b = make_policy(name).decide(snapshot(_with_progress(fleet, seed), items))
    assert placements(a) == placements(b)
