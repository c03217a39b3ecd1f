"""The fleet simulator: determinism, what policies can see, session bookkeeping, stalls."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest
import yaml

from broker.policies import make_policy
from broker.policies import base as policy_base
from broker.policies.base import Admission, Decision, Policy, Snapshot
from sim.fleet import FleetSim, SimulationError
from sim.scenario import load_scenario, parse_scenario
from sim.workloads.source import make_source
from sim.workloads.truth import SessionTruth, SimSession

QUICK = "scenarios/quick.yaml"


def tiny(iterations: int = 2, **trainer: object) -> tuple[typing.Any, str]:
    data = yaml.safe_load(open(QUICK))
    data["trainer"].update({"iterations": iterations, "batch_size": 16, "inflight_bound": 32, **trainer})
    return parse_scenario(data, origin="tiny"), QUICK


def run(policy: Policy, iterations: int = 2, **trainer: object) -> tuple[FleetSim, typing.Any]:
    scenario, path = tiny(iterations, **trainer)
    sim = FleetSim(scenario, policy, make_source(scenario, path))
    return sim, sim.run()


class Spy(Policy):
    """Admits oldest-first to the backend with the fewest resident sessions, up to `limit`
    residents in all (None: no limit); keeps snapshots."""

    name = "spy"

    def __init__(self, limit: int | None = None) -> None:
        self.snapshots: list[Snapshot] = []
        self.limit = limit

    def decide(self, snapshot: Snapshot) -> Decision:
        self.snapshots.append(snapshot)
        load = {b.backend_id: len(b.sessions) for b in snapshot.backends}
        out = Decision()
        for items in snapshot.pending.values():
            for item in items:
                if self.limit is not None and sum(load.values()) >= self.limit:
                    return out
                if item.turn:
                    raise AssertionError("a broker policy never sees follow-up turns")
                b = min(load, key=lambda k: (load[k], k))
                load[b] += 1
                out.admissions.append(Admission(item.session_id, b, item.prompt_tokens + item.max_tokens))
        return out


def test_same_seed_same_metrics() -> None:
    a = run(make_policy("least_loaded"))[1]
    b = run(make_policy("least_loaded"))[1]
    assert a.metrics == b.metrics
    assert [r.session_id for r in a.sessions] == [r.session_id for r in b.sessions]


def test_every_session_finishes_once_with_its_true_lengths() -> None:
    sim, res = run(Spy(), iterations=3)
    ids = [r.session_id for r in res.sessions]
    assert len(ids) == len(set(ids))
    assert res.completed and len(res.iterations) == 3
    for r in res.sessions:
        assert r.output_tokens > 0 and r.turns >= 1
        assert r.enqueued_at <= r.admitted_at <= r.first_token_at <= r.finished_at
    # Engines generated exactly what the sessions report (finished sessions are a subset of
    # all generated work, so the fleet total is at least the sum).
    generated = sum(e.stats().generation_tokens_total for e in sim.engines.values())
    assert generated >= sum(r.output_tokens for r in res.sessions)


def test_agentic_turns_stay_home_for_broker_policies_and_hit_the_cache() -> None:
    sim, res = run(Spy(), iterations=3)
    agentic = [r for r in res.sessions if r.workload == "agentic" and r.turns > 1]
    assert agentic, "the scenario must produce multi-turn sessions"
    # Turn 2+ prompts extend turn 1's history on the same engine: their prefix is cached.
    assert all(r.cached_tokens > 0 for r in agentic)


@pytest.mark.parametrize("policy", ["spy", "round_robin"])
def test_under_priority_scheduling_a_brokers_turns_carry_their_admission_time(
        policy: str, monkeypatch) -> None:
    """`fleet.scheduling_policy: priority`: a broker policy's turns carry their session's
    admission time in ms, as the live workers send it; a router's none."""
    from sim.engine.core import EngineCore

    seen: dict[str, list[int]] = {}
    add = EngineCore.add_request

    def recording(self, req):
        seen.setdefault(req.request_id.split("#")[0], []).append(req.priority)
        add(self, req)

    monkeypatch.setattr(EngineCore, "add_request", recording)
    data = yaml.safe_load(open(QUICK))
    data["trainer"].update({"iterations": 2, "batch_size": 16, "inflight_bound": 32})
    data["fleet"]["scheduling_policy"] = "priority"
    scenario = parse_scenario(data, origin="tiny")
    sim = FleetSim(scenario, Spy() if policy == "spy" else make_policy(policy),
                   make_source(scenario, QUICK))
    res = sim.run()
    assert all(e.scheduler.by_priority for e in sim.engines.values())
    admitted = {r.session_id: r.admitted_at for r in res.sessions}
    multi = [sid for sid, p in seen.items() if len(p) > 1]
    assert multi, "the scenario must produce multi-turn sessions"
    if policy == "round_robin":
        assert all(p == 0 for ps in seen.values() for p in ps)
    else:
        for sid, ps in seen.items():
            if sid in admitted:
                assert set(ps) == {int(admitted[sid] * 1000)}
        assert len({ps[0] for ps in seen.values()}) > 1


def test_a_router_runs_alike_on_engines_scheduling_by_priority() -> None:
    """A router sends no priority, and with equal priorities vLLM's `priority` policy is its
    `fcfs`: requests run in arrival order and are admitted in it, so the last running is the
    latest arrival. A bench that gives MISA-T priority engines gives the routers nothing."""
    def metrics(policy: str) -> tuple:
        data = yaml.safe_load(open(QUICK))
        data["trainer"].update({"iterations": 3, "batch_size": 16, "inflight_bound": 48})
        data["fleet"].update({"scheduling_policy": policy, "kv_tokens": 12_000})
        scenario = parse_scenario(data, origin="tiny")
        res = FleetSim(scenario, make_policy("cache_aware"), make_source(scenario, QUICK)).run()
        return res.metrics.preemptions, res.metrics.iteration_done_s, res.metrics.tokens_per_s

    fcfs, priority = metrics("fcfs"), metrics("priority")
    assert fcfs[0] > 0  # a full cache: the policies' victims are exercised
    assert priority == fcfs


def test_router_policies_place_every_turn() -> None:
    seen_turns: list[int] = []
    inner = make_policy("round_robin")

    class Recording(Policy):
        name = "recording"
        dispatch_on_arrival = True

        def decide(self, snapshot: Snapshot) -> Decision:
            seen_turns.extend(i.turn for items in snapshot.pending.values() for i in items)
            return inner.decide(snapshot)

    run(Recording(), iterations=2)
    assert max(seen_turns) >= 1, "follow-up turns must come back to a router as requests"


def _reachable(obj: object, seen: set[int]) -> typing.Iterator[object]:
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return
    seen.add(id(obj))
    yield obj
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _reachable(getattr(obj, f.name), seen)
    elif isinstance(obj, dict) or hasattr(obj, "items"):
        for k, v in obj.items():
            yield from _reachable(k, seen)
            yield from _reachable(v, seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            yield from _reachable(v, seen)


def test_no_snapshot_reaches_the_hidden_truth() -> None:
    spy = Spy()
    run(spy, iterations=2)
    assert spy.snapshots
    for snap in spy.snapshots[:50]:
        for obj in _reachable(snap, set()):
            assert not isinstance(obj, (SessionTruth, SimSession)), type(obj)


def test_snapshot_types_have_no_field_for_truth() -> None:
    """Structural: no type reachable from Snapshot can hold a SessionTruth or a SimSession."""
    hints_seen: set[type] = set()

    def walk(tp: object) -> None:
        for arg in typing.get_args(tp):
            walk(arg)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp) and tp not in hints_seen:
            hints_seen.add(tp)
            for hint in typing.get_type_hints(tp, vars(policy_base)).values():
                walk(hint)

    walk(Snapshot)
    assert policy_base.PendingItem in hints_seen and policy_base.ResidentSession in hints_seen
    assert not hints_seen & {SessionTruth, SimSession}


def test_a_policy_that_never_admits_is_reported() -> None:
    class Never(Policy):
        name = "never"

        def decide(self, snapshot: Snapshot) -> Decision:
            return Decision()

    with pytest.raises(SimulationError, match="admitted nothing"):
        run(Never())


def test_admitting_an_unknown_session_is_an_error() -> None:
    class Bad(Policy):
        name = "bad"

        def decide(self, snapshot: Snapshot) -> Decision:
            return Decision(admissions=[Admission("nope", "e0", 1)])

    with pytest.raises(SimulationError, match="unknown session"):
        run(Bad())


def test_profile_vocabulary_is_checked() -> None:
    data = yaml.safe_load(open(QUICK))
    data["vocab_size"] = 151_936  # larger than the h100-8b profile's 128,256
    scenario = parse_scenario(data, origin="x")
    with pytest.raises(SimulationError, match="vocab_size"):
        FleetSim(scenario, make_policy("round_robin"), make_source(scenario, QUICK))


def test_bench_json_is_byte_identical_for_a_seed(tmp_path) -> None:
    from sim.bench_cli import bench

    out = []
    for i in range(2):
        path = tmp_path / f"r{i}.json"
        bench(QUICK, ["least_loaded", "cache_aware"], seed=3, json_out=str(path), plots_dir=None,
              jobs=1, sweep_iterations=None)
        out.append(path.read_bytes())
    assert out[0] == out[1]
    report = json.loads(out[0])
    assert report["seed"] == 3 and set(report["policies"]) == {"least_loaded", "cache_aware"}
    # The headroom names the better of the two and divides the bound by its throughput.
    tok = {n: p["metrics"]["tokens_per_s"] for n, p in report["policies"].items()}
    room = report["headroom"]
    assert room["best_baseline"] == max(tok, key=tok.get)
    assert room["bound_x_best"] == pytest.approx(report["bound"]["tokens_per_s"] / max(tok.values()))


def test_a_warm_start_recalls_an_earlier_run_for_the_policies_that_learn() -> None:
    from sim.bench import RunSpec, earlier_run_seed, run_one

    warm = run_one(QUICK, 3, RunSpec("misa_t", warm=True))
    cold = run_one(QUICK, 3, RunSpec("misa_t"))
    assert warm.metrics != cold.metrics  # it started from what the seed-2 run learned
    earlier = run_one(QUICK, earlier_run_seed(3), RunSpec("misa_t"))
    # (a completion is handed over when generation ends; a session's record after its reward)
    assert len(earlier.completions) >= len(earlier.sessions) > 0
    for name in ("least_loaded", "cache_aware"):  # nothing to recall: the same run
        assert run_one(QUICK, 3, RunSpec(name, warm=True)).metrics == \
            run_one(QUICK, 3, RunSpec(name)).metrics


def test_bench_cli_names_the_bad_field(tmp_path) -> None:
    from typer.testing import CliRunner

    from rollout_broker.cli import app

    bad = tmp_path / "bad.yaml"
    data = yaml.safe_load(open(QUICK))
    data["workloads"]["rlvr"]["group_size"] = 0
    bad.write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(app, ["bench", "--scenario", str(bad), "--policies", "round_robin"])
    assert res.exit_code == 2
    assert "workloads.rlvr.group_size" in res.output
    res = CliRunner().invoke(app, ["bench", "--scenario", QUICK, "--policies", "nonesuch"])
    assert res.exit_code == 2 and "unknown policy 'nonesuch'" in res.output


def test_trace_replay_gives_the_same_run(tmp_path) -> None:
    """Export the sessions a run consumed as a JSONL trace, replay it: the same sessions finish."""
    from sim.trace import with_arrivals, write_trace

    scenario, path = tiny(2)
    source = make_source(scenario, path)
    sim = FleetSim(scenario, make_policy("least_loaded"), source)
    res = sim.run()
    sessions = with_arrivals([s for s, _ in sim.enqueued], {s.session_id: t for s, t in sim.enqueued})
    trace = tmp_path / "run.jsonl"
    write_trace(trace, sessions)
    data = yaml.safe_load(open(QUICK))
    data.pop("workloads")
    data.update(source="trace", trace=str(trace))
    data["trainer"].update({"iterations": 2, "batch_size": 16, "inflight_bound": 32})
    replay = parse_scenario(data, origin="replay")
    res2 = FleetSim(replay, make_policy("least_loaded"), make_source(replay, str(trace))).run()
    assert [r.session_id for r in res2.sessions][:32] == [r.session_id for r in res.sessions][:32]
    assert res2.metrics.tokens_per_s == pytest.approx(res.metrics.tokens_per_s)
    assert load_scenario(QUICK).name == "quick"


def _with(scenario_data_update: dict, iterations: int = 2, **trainer: object) -> FleetSim:
    data = yaml.safe_load(open(QUICK))
    data["trainer"].update({"iterations": iterations, "batch_size": 16, "inflight_bound": 32,
                            **trainer})
    data.update(scenario_data_update)
    scenario = parse_scenario(data, origin="tiny")
    return FleetSim(scenario, None, make_source(scenario, QUICK))


@pytest.mark.parametrize("lag", [0.0, 0.5, 2.0])
def test_telemetry_reaches_the_policy_as_old_as_the_live_system_delivers_it(lag):
    sim = _with({"telemetry": {"heartbeat_s": 1.0, "lag_s": lag}}, iterations=3)
    spy = Spy()
    sim.policy = spy
    sim.run()
    ages = [snap.now - b.telemetry.at for snap in spy.snapshots for b in snap.backends
            if b.telemetry is not None]
    assert ages and min(ages) >= lag - 1e-9  # never fresher than the lag allows
    assert max(ages) <= lag + 1.0 + 1e-9  # at most one period older than that


def test_a_sync_trainer_runs_step_by_step_and_the_engines_idle_while_it_trains():
    sim = _with({}, iterations=3, loop="sync", train_s=30.0)
    sim.policy = make_policy("least_loaded")
    res = sim.run()
    its = res.iterations
    assert len(its) == 3 and res.completed
    for prev, nxt in zip(its, its[1:]):
        # every session of a step was enqueued after the previous step's training ended
        step = {r.session_id: r for r in res.sessions if r.session_id in nxt.session_ids}
        assert min(r.enqueued_at for r in step.values()) >= prev.done_at + 30.0 - 1e-9
        assert len(nxt.session_ids) >= 16
    # the first step is the whole cold start: the steady state starts at its end
    assert res.metrics.cold.end == pytest.approx(its[0].done_at)


def test_run_metrics_warn_when_the_steady_state_is_too_short():
    res = run(make_policy("least_loaded"), iterations=2)[1]
    assert any("steady state" in w for w in res.metrics.warnings)


def test_session_progress_reaches_the_policy_with_the_heartbeats_lag():
    sim = _with({"telemetry": {"heartbeat_s": 1.0, "lag_s": 2.0}}, iterations=3)
    seen_behind = []

    class Watcher(Spy):
        def decide(self, snapshot: Snapshot) -> Decision:
            for b in snapshot.backends:
                for rs in b.sessions:
                    now = sim._progress[b.backend_id].get(rs.session_id)
                    if now is not None:
                        assert rs.generated_tokens <= now.generated_tokens
                        seen_behind.append(rs.generated_tokens < now.generated_tokens)
            return super().decide(snapshot)

    sim.policy = Watcher()
    sim.run()
    assert any(seen_behind)  # with a lag, the policy sees progress that has moved on since


def test_the_swept_baseline_is_tuned_on_another_seed_over_whole_runs(tmp_path) -> None:
    from sim.bench_cli import bench

    report = bench(QUICK, ["cache_aware", "cache_aware_swept"], seed=3,
                   json_out=str(tmp_path / "r.json"), plots_dir=None, jobs=1,
                   sweep_iterations=None)
    sweep = report["cache_aware_sweep"]
    assert sweep["seed"] == 4 and sweep["iterations"] is None  # not the evaluation run
    points = [p["params"] for p in sweep["points"]]
    assert {"cache_threshold": 0.3, "balance_abs_threshold": 64,
            "balance_rel_threshold": 1.5} in points  # the router's defaults are a candidate
    assert report["policies"]["cache_aware_swept"]["params"] == max(
        sweep["points"], key=lambda p: p["tokens_per_s"])["params"]


def test_no_policy_beats_the_fluid_bound() -> None:
    from sim.bound import fluid_bound

    scenario, path = tiny(4)
    bound = fluid_bound(scenario, path)
    for name in ("least_loaded", "cache_aware", "misa_t"):
        res = FleetSim(scenario, make_policy(name), make_source(scenario, path)).run()
        assert res.metrics.tokens_per_s < bound.tokens_per_s, name
        if res.metrics.steady is not None:
            assert res.metrics.steady.tokens_per_s < bound.tokens_per_s, name


def test_the_bound_holds_when_sessions_share_long_prompts() -> None:
    # GRPO groups of 16 behind 2,000-token prompts and short outputs: a group's prompt blocks
    # sit in KV once, so an engine holds many more sequences than its cache over their contexts.
    from sim.bound import fluid_bound

    data = yaml.safe_load(open(QUICK))
    data["fleet"]["kv_tokens"] = 40_000
    data["workloads"] = {"rlvr": {"group_size": 16, "max_tokens": 1024, "output_median": 150,
                                  "prompt": {"median": 2000, "sigma": 0.1, "cap": 3000}}}
    data["mixture"] = {"rlvr": 1.0}
    data["trainer"].update({"iterations": 4, "batch_size": 64, "inflight_bound": 256})
    scenario = parse_scenario(data, origin="shared-prompts")
    bound = fluid_bound(scenario, QUICK)
    res = FleetSim(scenario, make_policy("cache_aware"), make_source(scenario, QUICK)).run()
    assert res.metrics.tokens_per_s < bound.tokens_per_s
    assert bound.mean_kv_context < bound.mean_context / 3  # a group's prompt blocks count once


def test_the_bound_follows_the_cost_model() -> None:
    from sim.bound import fluid_bound

    scenario, path = tiny(4)
    base = fluid_bound(scenario, path)
    more = fluid_bound(scenario.model_copy(update={"fleet": scenario.fleet.model_copy(
        update={"engines": scenario.fleet.engines * 2})}), path)
    assert more.tokens_per_s > base.tokens_per_s
    assert base.limited_by in ("kv", "max_num_seqs", "inflight_bound")


def test_a_scenario_whose_turns_the_context_cap_cuts_says_so() -> None:
    from sim.scenario_checks import scenario_warnings

    data = yaml.safe_load(open(QUICK))
    agentic = data["workloads"]["agentic"]
    agentic.update({"max_turns": 60, "turns": {"median": 40, "sigma": 0.3}})
    cut = parse_scenario(data, origin="long-episodes")
    [warning] = [w for w in scenario_warnings(cut, QUICK) if ".turns:" in w]
    assert warning.startswith("workloads.agentic.turns: episodes get") and "ends them first" in warning
    agentic.update({"max_turns": 3, "min_turns": 2, "turns": {"median": 2, "sigma": 0.1}})
    assert not [w for w in scenario_warnings(parse_scenario(data, origin="short"), QUICK)
                if ".turns:" in w]


def test_misa_t_runs_a_contended_fleet_about_as_full_as_the_router_and_preempts_less() -> None:
    """Two engines of 60K KV tokens, 256 sessions in flight: the router fills the engines and
    preempts; MISA-T's charges are expected *final* contexts, which the residents do not reach
    together, so without the loop between charged and used KV it idled half the cache (KV
    0.55 against 0.95 before the loop)."""
    data = yaml.safe_load(open(QUICK))
    data["fleet"]["kv_tokens"] = 60_000
    data["trainer"].update({"iterations": 10, "inflight_bound": 256})
    scenario = parse_scenario(data, origin="contended")
    out = {}
    for name in ("cache_aware", "misa_t"):
        out[name] = FleetSim(scenario, make_policy(name), make_source(scenario, QUICK)).run().metrics
    router, misa = out["cache_aware"], out["misa_t"]
    assert router.kv_utilisation > 0.9 and router.preemptions > 0
    assert misa.kv_utilisation >= 0.85 * router.kv_utilisation
    assert misa.preemptions < 0.5 * router.preemptions


def test_heartbeats_report_the_kv_an_engine_holds_as_it_decodes():
    """One session at a time on the fleet: its engine decodes it as one long decode run (no
    event until it finishes), and each heartbeat meanwhile reports the KV its steps so far
    hold, as vLLM's /metrics do, not the KV it held when the run began."""
    sim = _with({"telemetry": {"heartbeat_s": 0.5, "lag_s": 0.0}}, iterations=1)
    sim.policy = Spy(limit=1)
    sim.run()
    by_engine: dict[str, list[float]] = {}
    for s in sim.kv_samples:
        by_engine.setdefault(s.engine_id, []).append(s.usage)
    pairs = [(a, b) for usage in by_engine.values() for a, b in zip(usage, usage[1:])
             if a > 0 and b > 0]
    assert len(pairs) > 20
    assert sum(b > a for a, b in pairs) > 0.5 * len(pairs)


@pytest.mark.parametrize("progress", ["turn_end", "decoding"])
def test_a_turn_in_flight_shows_progress_only_to_a_streaming_worker(progress):
    """The worker sends a turn as one request and learns its output when the engine answers:
    until then its beats show the turn's prompt (`turn_end`, the default). `decoding` reports
    the tokens decoded so far, as a worker streaming its requests would: one session at a time
    (one long decode run), every beat shows more."""
    sim = _with({"telemetry": {"heartbeat_s": 0.5, "lag_s": 0.0, "progress": progress}},
                iterations=2)
    spy = Spy(limit=1)
    sim.policy = spy
    sim.run()
    seen: dict[str, list[int]] = {}
    for snap in spy.snapshots:
        for b in snap.backends:
            for rs in b.sessions:
                if rs.max_turns == 1:
                    seen.setdefault(rs.session_id, []).append(rs.generated_tokens)
    pairs = [(a, b) for beats in seen.values() for a, b in zip(beats, beats[1:])]
    assert len(pairs) > 100
    if progress == "turn_end":
        assert max(max(beats) for beats in seen.values()) == 0  # gone once its turn ends
    else:
        assert sum(b > a for a, b in pairs) > 0.8 * len(pairs)
