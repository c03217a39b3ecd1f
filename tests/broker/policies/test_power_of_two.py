import random

from broker.policies import make_policy
from tests.broker.policies.snapshots import backend, item, placements, snapshot


def _fleet() -> list:
    return [backend(f"b{i}", in_flight=i) for i in range(6)]


def test_same_seed_same_choices_different_seed_differs() -> None:
    items = [item(f"s{i}", enqueued_at=float(i)) for i in range(40)]
    runs = [
        placements(make_policy("power_of_two", seed=seed).decide(snapshot(_fleet(), items)))
        for seed in (7, 7, 8)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_picks_the_less_loaded_of_the_two_it_samples() -> None:
    seed = 3
    rng = random.Random(seed)  # replays the policy's draws
    backends = _fleet()
    policy = make_policy("power_of_two", seed=seed)
    decision = policy.decide(snapshot(backends, [item(f"s{i}") for i in range(30)]))
    load = {b.backend_id: b.in_flight for b in backends}
    for _, chosen in placements(decision):
        i = rng.randrange(6)
        j = rng.randrange(6)
        while j == i:
            j = rng.randrange(6)
        a, b = f"b{i}", f"b{j}"
        assert chosen == (a if load[a] <= load[b] else b)
        load[chosen] += 1


def test_never_picks_the_most_loaded_of_two_backends() -> None:
    backends = [backend("idle", 0), backend("busy", 50)]
    decision = make_policy("power_of_two", seed=1).decide(
        snapshot(backends, [item(f"s{i}") for i in range(20)])
    )
    assert {b for _, b in placements(decision)} == {"idle"}


def test_single_healthy_backend_gets_everything() -> None:
    backends = [backend("a", healthy=False), backend("b", 3), backend("c", healthy=False)]
    decision = make_policy("power_of_two").decide(snapshot(backends, [item("s1"), item("s2")]))
    assert placements(decision) == [("s1", "b"), ("s2", "b")]
