"""misa_t_placement: the loop and the array evaluations of the choice rule agree on every step."""

from __future__ import annotations

import random

import pytest

from broker.policies.base import BackendView
from broker.policies.misa_t_placement import BackendState, Placement


def fleet(n: int, rng: random.Random) -> list[BackendState]:
    out = []
    for i in range(n):
        capacity = rng.choice((60_000, 120_000, 690_000))
        view = BackendView(backend_id=f"b{i}", capacity_tokens=capacity, max_model_len=65_536,
                           healthy=True, alpha=1.0, telemetry=None, sessions=())
        limit = capacity * rng.choice((0.8, 1.0, 1.1, 1.6))
        # Some equal states, so that ties (first in fleet order wins) are exercised.
        reserved = rng.choice((0.0, capacity * 0.5, rng.uniform(0, limit)))
        out.append(BackendState(view, limit, reserved, rng.choice((0, 3, rng.randrange(40)))))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_loops_and_arrays_choose_the_same_backend_through_a_call(seed):
    rng = random.Random(seed)
    n = rng.choice((1, 2, 5, 16, 64, 200))
    fleets = fleet(n, rng)
    twins = [BackendState(b.view, b.limit, b.reserved, b.running) for b in fleets]
    loops = Placement(fleets, locality_slack=rng.choice((0.0, 0.05, 0.15, 1.0)), use_arrays=False)
    arrays = Placement(twins, locality_slack=loops.locality_slack, use_arrays=True)
    held = rng.sample(range(n), rng.randrange(0, min(n, 4)))
    pool_l = loops.pool([fleets[i] for i in held])
    pool_a = arrays.pool([twins[i] for i in held])
    chosen = 0
    hits_l = hits_a = None
    charge, run_slack, min_hit = 500.0, 1.0, 0.0
    for _ in range(600):
        if rng.random() < 0.4:  # a new key (else the group's next member: same key and charge)
            charge = rng.choice((500.0, 4_000.0, 20_000.0, rng.uniform(1, 80_000)))
            run_slack = rng.choice((0.0, 1.0, 2.5, 6.0))
            min_hit = rng.choice((0.0, 0.0, 1024.0, 3000.0))
            matched = (None if rng.random() < 0.3 else
                       {f"b{i}": rng.choice((16, 1024, 4096)) for i in rng.sample(range(n), rng.randrange(n + 1))}
                       | ({"gone": 64} if rng.random() < 0.1 else {}))
            hits_l = loops.hits(matched) if matched is not None else None
            hits_a = arrays.hits(matched) if matched is not None else None
        a, hit_a = loops.choose(pool_l, charge, hits_l, run_slack, min_hit)
        b, hit_b = arrays.choose(pool_a, charge, hits_a, run_slack, min_hit)
        assert (a.view.backend_id if a else None, hit_a) == (b.view.backend_id if b else None, hit_b)
        assert loops.fits(pool_l, charge) is arrays.fits(pool_a, charge) is (a is not None)
        kept_l, kept_a = loops.most_room(pool_l, charge), arrays.most_room(pool_a, charge)
        assert (kept_l and kept_l.view.backend_id) == (kept_a and kept_a.view.backend_id)
        big = [s for s in fleets if s in pool_l.members and s.limit >= charge]
        assert kept_l is (max(big, key=lambda s: s.headroom) if big else None)
        if a is None:
            continue
        chosen += 1
        # The chosen backend takes the admission; now and then it instead gives KV and a
        # session back (a placement must not assume what comes next only adds).
        shrink = rng.random() < 0.1
        for target, placement, hits in ((a, loops, hits_l), (b, arrays, hits_a)):
            if shrink:
                target.reserved = max(0.0, target.reserved - 3 * charge)
                target.running = max(0, target.running - 2)
            else:
                target.reserved += charge
                target.running += 1
            placement.placed(target)
            if hits is not None:
                placement.key_placed(hits, target, 8192)
        if rng.random() < 0.2:  # a follow-up turn placed at home meanwhile, not by choice
            i = rng.randrange(n)
            grow, more, cached = rng.choice((1_000.0, 30_000.0)), rng.choice((1, 8)), rng.random() < 0.5
            for placement, states, hits in ((loops, fleets, hits_l), (arrays, twins, hits_a)):
                states[i].reserved += grow
                states[i].running += more
                placement.placed(states[i])
                if hits is not None and cached:  # (its prompt shares the group's prefix)
                    placement.key_placed(hits, states[i], 8192)
    assert chosen > 0


@pytest.mark.parametrize("seed", range(20))
def test_a_placement_kept_across_calls_and_synced_chooses_as_a_new_one(seed):
    """MisaT keeps its Placement while the fleet is the same backends and hands it the states
    that moved since the last call (`sync`): a new α (limit), a new cache size, reservations and
    running counts set back from the ledger. Every choice must then be that of a placement
    built afresh over the same states."""
    import dataclasses
    rng = random.Random(100 + seed)
    n = rng.choice((2, 16, 130))
    states = fleet(n, rng)
    kept = {mode: Placement(states, 0.15, use_arrays=mode) for mode in (False, True)}
    for _call in range(30):
        moved = rng.sample(states, rng.randrange(0, n + 1))
        for b in moved:
            what = rng.randrange(4)
            if what == 0:
                b.limit = b.view.capacity_tokens * rng.choice((0.5, 1.0, 1.3))
            elif what == 1:
                b.view = dataclasses.replace(b.view, capacity_tokens=rng.choice((40_000, 500_000)))
            elif what == 2:
                b.reserved = rng.uniform(0, b.limit)
            else:
                b.running = rng.randrange(50)
        for placement in kept.values():
            placement.sync(moved)
        fresh = Placement(states, 0.15, use_arrays=True)
        for _ in range(20):
            charge = rng.choice((500.0, 20_000.0, rng.uniform(1, 400_000)))
            run_slack = rng.choice((0.0, 1.0, 6.0))
            want = fresh.choose(fresh.pool(), charge, None, run_slack)
            for placement in kept.values():
                assert placement.choose(placement.pool(), charge, None, run_slack) == want
                assert placement.fits(placement.pool(), charge) is (want[0] is not None)
