"""The fleet simulator's indexes (issue 17, item 4): the heap of engine next-event times, the
cached backend views, the pending-id set, the set of engines with unfinished requests and the
ledger entries handed to `apply_decision`. `FleetSim(check=True)` compares each of them with a
full scan on every event and every decide; these runs cover every path that moves an engine's
next event time (arrivals, steps, aborts, settle, freeze/unfreeze) or a backend's view
(admissions, recharges, releases, heartbeats with and without lag, α changes), for broker
policies and routers. A missed invalidation raises SimulationError("check: ...")."""

from __future__ import annotations

import dataclasses
import random
import typing

import pytest
import yaml

from broker.policies import make_policy
from broker.policies.base import Decision, Policy, Snapshot
from sim.engine.core import EngineCore
from sim.engine.profiles import get_profile
from sim.engine.request import EngineRequest
from sim.fleet import FleetResult, FleetSim, SimulationError
from sim.scenario import parse_scenario
from sim.workloads.source import make_source

QUICK = "scenarios/quick.yaml"


def scenario(iterations: int = 3, lag_s: float | None = None, engines: int = 3,
             heartbeat_s: float | None = None, **trainer: typing.Any) -> typing.Any:
    data = yaml.safe_load(open(QUICK))
    data["fleet"]["engines"] = engines
    data["trainer"].update({"iterations": iterations, "batch_size": 16, "inflight_bound": 32,
                            **trainer})
    data["telemetry"] = {k: v for k, v in (("lag_s", lag_s), ("heartbeat_s", heartbeat_s))
                         if v is not None}
    return parse_scenario(data, origin="index-check")


class Meddler(Policy):
    """MISA-T, plus on every call an α change on one backend and a recharge of one resident
    session elsewhere: ledger changes that come without a heartbeat."""

    name = "meddler"

    def __init__(self) -> None:
        self.inner = make_policy("misa_t")
        self.calls = 0

    def decide(self, snapshot: Snapshot) -> Decision:
        out = self.inner.decide(snapshot)
        self.calls += 1
        backends = snapshot.backends
        b = backends[self.calls % len(backends)]
        out.alpha[b.backend_id] = 0.9 if self.calls % 2 else 1.0
        other = backends[(self.calls + 1) % len(backends)]
        if other.sessions:
            rs = other.sessions[self.calls % len(other.sessions)]
            out.recharge[rs.session_id] = max(0, rs.reserved_tokens + (16 if self.calls % 3 else -16))
        return out


def make(policy: str) -> Policy:
    return Meddler() if policy == "meddler" else make_policy(policy)


def simulate(sc: typing.Any, policy: str, check: bool) -> FleetResult:
    return FleetSim(sc, make(policy), make_source(sc, QUICK), check=check).run()


def outcome(res: FleetResult) -> tuple[typing.Any, ...]:
    """Everything a run produces that is simulated (no wall-clock field)."""
    return (res.metrics, res.iterations, res.sessions, res.kv_samples, res.engines,
            res.completed, res.sim_time_s, res.decide_calls)


CASES = {
    "broker": ("misa_t", {}),
    "broker-lag0": ("misa_t", {"lag_s": 0.0}),
    "meddler": ("meddler", {"heartbeat_s": 10.0}),
    "meddler-lag0": ("meddler", {"lag_s": 0.0, "heartbeat_s": 5.0}),
    "router": ("round_robin", {}),
    "router-cache-aware": ("cache_aware", {}),
    "least-loaded-lag0": ("least_loaded", {"lag_s": 0.0}),
    "abort": ("misa_t", {"weight_update": {"mode": "abort", "sync_s": 2.0}}),
    "abort-router": ("round_robin", {"weight_update": {"mode": "abort", "sync_s": 2.0, "partial": False}}),
    "keep": ("misa_t", {"weight_update": {"mode": "keep", "sync_s": 3.0}}),
    "keep-router": ("least_loaded", {"weight_update": {"mode": "keep", "sync_s": 3.0}}),
    "wait": ("misa_t", {"weight_update": {"mode": "wait", "sync_s": 2.0, "clear_cache": False},
                        "train_s": 5.0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_indexes_match_a_full_scan(case: str) -> None:
    """Every event and every decide with the scans on: no index differs, and the run's results
    are those of the run without the scans."""
    policy, kw = CASES[case]
    sc = scenario(**kw)
    checked = simulate(sc, policy, check=True)
    assert checked.completed
    if "weight_update" in kw:
        assert checked.metrics.weight_updates.updates > 0
    assert outcome(checked) == outcome(simulate(sc, policy, check=False))


def test_check_catches_a_missed_engine_notification() -> None:
    """An engine that stops reporting its changes leaves a stale heap entry, which the check
    finds (the guard the tests above rely on)."""
    sc = scenario(iterations=2)
    sim = FleetSim(sc, make_policy("least_loaded"), make_source(sc, QUICK), check=True)
    sim.engines["e1"].on_change = None
    with pytest.raises(SimulationError, match="check: the next-event heap"):
        sim.run()


def test_check_catches_a_stale_backend_view() -> None:
    """A change to a backend's resident sessions that does not mark its view stale is found."""

    class Forgetful(FleetSim):
        def _release(self, live: typing.Any) -> None:
            super()._release(live)
            self._stale_views.discard(live.backend)

    sc = scenario(iterations=2)
    sim = Forgetful(sc, make_policy("misa_t"), make_source(sc, QUICK), check=True)
    with pytest.raises(SimulationError, match="check: stale backend views"):
        sim.run()


def test_views_are_reused_until_a_backend_changes() -> None:
    """Consecutive snapshots share the BackendView objects of backends that did not change."""
    seen: list[tuple[typing.Any, ...]] = []
    policy = make_policy("misa_t")
    decide = policy.decide

    def spy(snapshot: typing.Any) -> typing.Any:
        seen.append(snapshot.backends)
        return decide(snapshot)

    policy.decide = spy  # type: ignore[method-assign]
    sc = scenario(iterations=2, engines=4)
    FleetSim(sc, policy, make_source(sc, QUICK)).run()
    shared = sum(a is b for prev, cur in zip(seen, seen[1:]) for a, b in zip(prev, cur))
    assert shared > 0
    for views in seen:
        assert all(dataclasses.is_dataclass(v) for v in views)


# -- the engine's side: every change of next_event_time() is reported ----------------------------

PROFILE = dataclasses.replace(get_profile("h100-8b"), kv_tokens=16 * 12, max_num_batched_tokens=48,
                              max_num_seqs=4)


@pytest.mark.parametrize("bulk", [True, False])
def test_engine_reports_every_change_of_its_next_event(bulk: bool) -> None:
    """After every public call, next_event_time() and has_unfinished() are what they were
    when the engine last called `on_change`: a driver that indexes them is never stale.
    Random calls, as the fleet (to the next event) and the HTTP driver (to a clock) make them."""
    rng = random.Random(17)
    ops = ["add", "add", "add", "abort", "settle", "settle", "freeze", "unfreeze", "step",
           "step", "step", "step", "tick"]
    calls: dict[str, int] = {}
    for _ in range(100):
        core = EngineCore(PROFILE, bulk=bulk)
        reported = [(core.next_event_time(), core.has_unfinished())]
        core.on_change = lambda c=core: reported.append((c.next_event_time(), c.has_unfinished()))
        clock = 0.0
        ids: list[str] = []
        for i in range(80):
            op = rng.choice(ops)
            before = (core.next_event_time(), core.has_unfinished())
            if op == "add":
                plen = rng.randint(1, 100)
                out = min(rng.randint(1, 40), core.max_model_len - plen)
                base = rng.randrange(4) * 31  # a few shared prefixes: prefix-cache hits
                ids.append(f"r{i}")
                core.add_request(EngineRequest(ids[-1], [base + j for j in range(plen)], out, output_len=out,
                                               arrival_time=clock + rng.uniform(0, 0.2)))
            elif op == "abort":
                if not ids:
                    continue
                core.abort_request(rng.choice(ids))
            elif op == "settle":
                core.settle(clock)
            elif op == "freeze":
                core.freeze(clock)
            elif op == "unfreeze":
                core.unfreeze(clock)
            elif op == "step":  # the fleet's way: to the engine's next event
                t = core.next_event_time()
                if t is None:
                    continue
                clock = max(clock, t)
                core.advance(t)
            else:  # the HTTP driver's way: to a clock of its own
                clock += rng.uniform(0, 0.2)
                core.advance(clock)
            assert (core.next_event_time(), core.has_unfinished()) == reported[-1], op
            if (core.next_event_time(), core.has_unfinished()) != before:
                calls[op] = calls.get(op, 0) + 1
    # Each kind of call did move the engine's next event (or its unfinished state) somewhere;
    # settle only can when a bulk decode run is planned.
    kinds = {"add", "abort", "freeze", "unfreeze", "step", "tick"} | ({"settle"} if bulk else set())
    assert set(calls) == kinds, calls


def test_run_restores_the_collector_thresholds() -> None:
    """run() raises the cyclic collector's young threshold for its own duration only."""
    import gc

    before = gc.get_threshold()
    sc = scenario(iterations=1)
    FleetSim(sc, make_policy("least_loaded"), make_source(sc, QUICK)).run()
    assert gc.get_threshold() == before
