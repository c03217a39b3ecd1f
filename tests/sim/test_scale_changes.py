"""Engines joining and leaving the simulated fleet mid-run (`fleet.changes`): a scale-out and a
scale-in through the worker's drain deliver every session exactly once, generate nothing twice,
and a leaving engine takes no admission; what the run and the bench report; bad change specs."""

from __future__ import annotations

import json
import math
import typing
from collections import Counter

import pytest
import yaml
from rich.console import Console

from broker.policies import make_policy
from sim.engine.request import EngineRequest
from sim.fleet import FleetSim
from sim.metrics import KvSample, kv_utilisation
from sim.scenario import ScenarioError, load_scenario, parse_scenario
from sim.workloads.source import make_source

DEMO = "scenarios/demo.yaml"
SCALE = "scenarios/scale.yaml"
POLICIES = ("round_robin", "least_loaded", "power_of_two", "cache_aware", "misa_t")
# 2 engines, 2 more at 10 s, the two newest leave at 25 s: the run goes on past 40 s.
OUT_THEN_IN = [{"at_s": 10, "add": 2}, {"at_s": 25, "remove": 2}]


def scenario(changes: list[dict], iterations: int = 24, **fleet: typing.Any) -> typing.Any:
    data = yaml.safe_load(open(DEMO))
    data["fleet"].update({"engines": 2, "changes": changes, **fleet})
    data["trainer"]["iterations"] = iterations
    return parse_scenario(data, origin="scale-test")


class Watched(FleetSim):
    """Records, apart from the simulator's own accounting: the output tokens every engine
    request generated per session, each admission the ledger accepted, each engine's removal,
    and the backends of every snapshot the policy got."""

    def __init__(self, *args: typing.Any, **kwargs: typing.Any) -> None:
        super().__init__(*args, **kwargs)
        self.generated: Counter[str] = Counter()
        self.admitted: list[tuple[float, str, str]] = []  # (at, backend, session)
        self.removed: dict[str, float] = {}
        self.seen: list[tuple[float, tuple[str, ...]]] = []  # (at, backends in the snapshot)

    def _on_turn_finished(self, req: EngineRequest) -> None:
        self.generated[req.request_id.split("#")[0]] += req.num_output_tokens
        super()._on_turn_finished(req)

    def _apply(self, decision: typing.Any) -> None:
        super()._apply(decision)
        for adm in decision.admissions:
            if adm.session_id not in self._pending_ids:  # accepted: no longer pending
                self.admitted.append((self.now, adm.backend_id, adm.session_id))

    def _begin_leaving(self, b: str, grace_s: float) -> None:
        self.removed[b] = self.now
        super()._begin_leaving(b, grace_s)

    def _maybe_decide(self) -> None:
        if self._dirty and any(self.pending.values()) and self._pause is None:
            self.seen.append((self.now, tuple(v.backend_id for v in self._backend_views())))
        super()._maybe_decide()


def run(policy: str, changes: list[dict] = OUT_THEN_IN, **kwargs: typing.Any
        ) -> tuple[Watched, typing.Any]:
    sc = scenario(changes, **kwargs)
    sim = Watched(sc, make_policy(policy), make_source(sc, DEMO), check=True)
    return sim, sim.run()


def assert_exactly_once_and_nothing_lost(sim: Watched, res: typing.Any) -> None:
    truth = {s.session_id: s.truth.output_tokens for s, _ in sim.enqueued}
    ids = [r.session_id for r in res.sessions]
    assert len(ids) == len(set(ids)), "a session was delivered twice"
    assert set(ids) <= truth.keys()
    for r in res.sessions:
        # Each turn exactly as long as its truth, and every token the engines generated for
        # the session is in its result: nothing generated twice, nothing thrown away.
        assert r.output_tokens == sum(truth[r.session_id][:r.turns]), r.session_id
        assert sim.generated[r.session_id] == r.output_tokens, r.session_id
    # What was not delivered is still in flight, and on no engine that has left.
    assert set(truth) - set(ids) == set(sim.live)
    for live in sim.live.values():
        if live.request is not None:
            assert live.backend not in sim.members.gone, live.sim.session_id
    assert not sim.members.gone & sim.ledger.keys()
    charged = [sid for entry in sim.ledger.values() for sid in entry.sessions]
    assert len(charged) == len(set(charged)) and set(charged) <= sim.live.keys()
    assert res.metrics.scale.tokens_lost_to_scale_in == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_scale_out_then_in_delivers_every_session_once_and_loses_no_token(policy: str) -> None:
    sim, res = run(policy)
    sc = res.metrics.scale
    assert res.completed
    assert (sc.engines_joined, sc.engines_left) == (2, 2)
    assert sc.sessions_handed_back > 0 and sc.tokens_handed_back > 0  # cut mid-turn, kept
    assert sim.members.visible == ["e0", "e1"] and set(sim.removed) == {"e2", "e3"}
    assert {b for _, b, _ in sim.admitted} == {"e0", "e1", "e2", "e3"}  # the new ones served
    assert_exactly_once_and_nothing_lost(sim, res)


@pytest.mark.parametrize("policy", ["misa_t", "round_robin"])
def test_a_leaving_engine_takes_no_admission_and_leaves_the_snapshot(policy: str) -> None:
    sim, res = run(policy, [{"at_s": 10, "add": 2}, {"at_s": 25, "remove": 2, "drain_grace_s": 4}])
    assert res.metrics.scale.engines_left == 2
    for at, b, sid in sim.admitted:
        assert b not in sim.removed or at < sim.removed[b], f"{sid} admitted to {b} at {at}"
    for at, backends in sim.seen:
        assert not [b for b in backends if b in sim.removed and at >= sim.removed[b]], at
    # The grace lets sessions finish first; when it ends, what still runs is cut at the end of
    # the engine step in flight (well under a second), and the engine has left.
    left = sim.members.present
    for b, removed_at in sim.removed.items():
        assert removed_at <= left[b][1] < removed_at + 4 + 1
    assert_exactly_once_and_nothing_lost(sim, res)


def test_an_added_engine_is_in_the_snapshot_from_its_first_heartbeat() -> None:
    sim, res = run("misa_t", [{"at_s": 10.3, "add": 1}])
    hb, lag = sim.heartbeat_s, sim.lag_s
    first_beat = math.ceil(10.3 / hb) * hb  # the first heartbeat taken after it joined
    with_e2 = [at for at, backends in sim.seen if "e2" in backends]
    without = [at for at, backends in sim.seen if "e2" not in backends]
    assert with_e2 and min(with_e2) >= first_beat + lag - 1e-9
    assert max(without) < first_beat + lag + 1e-9
    assert min(at for at, b, _ in sim.admitted if b == "e2") >= first_beat + lag - 1e-9
    assert res.metrics.scale.engines_joined == 1 and res.metrics.scale.engines_left == 0


def test_dropping_the_partial_output_on_a_hand_back_would_be_counted_as_lost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The loss figure measures: with a hand-back that forgets the cut turn's output (the
    session regenerates it), it counts exactly the tokens generated twice."""
    original = FleetSim._on_turn_stopped

    def forgetful(self: FleetSim, live: typing.Any, req: EngineRequest) -> None:
        scale_in = live.backend in self.members.cut
        partial, history = list(live.partial), list(live.history)
        original(self, live, req)
        if scale_in:  # as if the worker had handed the session back without its output
            live.partial, live.history = partial, history

    monkeypatch.setattr(FleetSim, "_on_turn_stopped", forgetful)
    sc = scenario(OUT_THEN_IN)
    sim = FleetSim(sc, make_policy("round_robin"), make_source(sc, DEMO))
    res = sim.run()
    handed = res.metrics.scale.tokens_handed_back
    assert handed > 0 and 0 < res.metrics.scale.tokens_lost_to_scale_in <= handed


def test_runs_with_fleet_changes_are_deterministic() -> None:
    a, b = (run("power_of_two")[1] for _ in range(2))
    assert a.sessions == b.sessions and a.metrics == b.metrics


def test_kv_utilisation_counts_an_engine_only_while_it_is_in_the_fleet() -> None:
    samples = [KvSample(0.0, "e0", 0.5), KvSample(5.0, "e1", 1.0), KvSample(8.0, "e1", 0.0)]
    # e0 at 0.5 over [0, 10]; e1 joined at 5, at 1.0 until it left at 8: (5 + 3) / (10 + 3).
    present = {"e0": (0.0, float("inf")), "e1": (5.0, 8.0)}
    assert kv_utilisation(samples, 0.0, 10.0, present) == pytest.approx(8.0 / 13.0)
    fixed = [KvSample(0.0, "e0", 0.5), KvSample(0.0, "e1", 1.0)]
    both = {"e0": (0.0, float("inf")), "e1": (0.0, float("inf"))}
    assert kv_utilisation(fixed, 0.0, 10.0, both) == kv_utilisation(fixed, 0.0, 10.0) == 0.75


@pytest.mark.parametrize(("changes", "message"), [
    ([{"at_s": 10, "add": 1}, {"at_s": 5, "remove": 1}],
     r"fleet: changes\.1\.at_s: 5 s is before the change above it"),
    ([{"at_s": 10, "remove": 2}], r"fleet: changes\.0\.remove: removes 2 at 10 s, where 2 serve"),
    ([{"at_s": 1, "add": 1}, {"at_s": 2, "remove": 1}, {"at_s": 3, "remove": 2}],
     r"fleet: changes\.2\.remove: removes 2 at 3 s, where 2 serve"),
    ([{"at_s": 10, "add": 1, "remove": 1}], r"fleet\.changes\.0: give exactly one of add"),
    ([{"at_s": 10}], r"fleet\.changes\.0: give exactly one of add"),
    ([{"at_s": 1, "add": 1, "drain_grace_s": 3}],
     r"fleet\.changes\.0: drain_grace_s: only a remove"),
    ([{"at_s": 1, "add": 0}], r"fleet\.changes\.0\.add: must be ≥ 1"),
    ([{"at_s": -1, "add": 1}], r"fleet\.changes\.0\.at_s: must be ≥ 0"),
    ([{"at_s": 1, "remove": 1, "drain_grace_s": -1}],
     r"fleet\.changes\.0\.drain_grace_s: must be ≥ 0"),
    ([{"at_s": 1, "ad": 2}], r"fleet\.changes\.0\.ad: unknown field"),
])
def test_bad_fleet_changes_name_the_field(changes: list[dict], message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        scenario(changes)


def test_the_shipped_scale_scenario_grows_then_shrinks_its_fleet() -> None:
    sc = load_scenario(SCALE)
    serving = [sc.fleet.engines]
    for change in sc.fleet.changes:
        serving.append(serving[-1] + (change.add or -change.remove))
    assert serving[0] < max(serving) and serving[-1] < max(serving)


def test_bench_reports_what_the_fleet_changes_did(tmp_path) -> None:
    from sim.bench_cli import bench

    data = yaml.safe_load(open(SCALE))
    data["trainer"]["iterations"] = 40
    data["fleet"]["changes"] = OUT_THEN_IN
    path = tmp_path / "scale.yaml"
    path.write_text(yaml.safe_dump(data))
    console = Console(record=True, width=250)
    report = bench(str(path), ["misa_t"], None, str(tmp_path / "out.json"), plots_dir=None,
                   jobs=1, sweep_iterations=None, console=console)
    sc = report["policies"]["misa_t"]["metrics"]["scale"]
    assert sc["engines_joined"] == sc["engines_left"] == 2
    assert sc["sessions_handed_back"] > 0 and sc["tokens_lost_to_scale_in"] == 0
    assert json.loads((tmp_path / "out.json").read_text())["policies"]["misa_t"]["metrics"][
        "scale"] == sc
    text = console.export_text()
    assert "fleet changes" in text and f"{sc['tokens_handed_back']:,}" in text
