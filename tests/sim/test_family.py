"""The scenario family: deterministic draws inside the ranges, and the family/sweep benches."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rollout_broker.cli import app
from sim.family import FamilySpec, load_family, sample_family
from sim.bench_family import parse_sweep, summarize_headroom, summarize_headroom_taken, with_field
from sim.scenario import ScenarioError, load_scenario

FAMILY = "scenarios/family.yaml"


def test_the_same_seed_draws_the_same_scenarios_within_the_ranges():
    spec = load_family(FAMILY)
    a = sample_family(spec, FAMILY, 20, seed=5)
    b = sample_family(spec, FAMILY, 20, seed=5)
    assert [s.model_dump() for s in a] == [s.model_dump() for s in b]
    assert [s.model_dump() for s in sample_family(spec, FAMILY, 20, seed=6)] != \
        [s.model_dump() for s in a]
    loops = set()
    for s in a:
        assert spec.engines[0] <= s.fleet.engines <= spec.engines[1]
        assert s.fleet.profile in spec.profiles
        assert spec.kv_tokens[0] <= s.fleet.kv_tokens <= spec.kv_tokens[1]
        assert sum(s.mixture.values()) == pytest.approx(1.0)
        for w, ws in s.workloads.items():
            lo, hi = spec.group_size[w]
            assert lo <= ws.group_size <= hi
        t = s.trainer
        loops.add(t.loop if t.loop == "sync" else (t.mode, t.max_staleness))
        if t.loop == "async":  # long enough for the steady state to turn the buffer over
            assert t.iterations * t.batch_size >= (spec.turnovers + 1) * t.inflight_bound
    assert len(loops) >= 3  # the loops vary across the draws
    assert len({s.seed for s in a}) == 20


def test_a_bad_family_names_the_field(tmp_path):
    bad = tmp_path / "f.yaml"
    bad.write_text(yaml.safe_dump({"name": "f", "base": "quick.yaml", "profiles": ["h100-8b"],
                                   "engines": [4, 2]}))
    with pytest.raises(ScenarioError, match=r"^f.yaml: engines: need 0 < low ≤ high, got \[4, 2\]$"):
        load_family(bad)
    assert FamilySpec.model_fields["loops"].default  # every loop by default


def test_sweep_sets_one_field():
    key, values = parse_sweep("trainer.inflight_bound=32,64")
    assert key == "trainer.inflight_bound" and values == [32, 64]
    s = with_field(load_scenario("scenarios/quick.yaml"), key, 64)
    assert s.trainer.inflight_bound == 64
    with pytest.raises(ValueError, match="no field 'nope'"):
        with_field(load_scenario("scenarios/quick.yaml"), "trainer.nope", 1)
    with pytest.raises(ValueError, match="KEY=V1,V2"):
        parse_sweep("trainer.inflight_bound")


def test_family_bench_reports_ratios_min_and_geomean(tmp_path):
    fam = tmp_path / "tiny.yaml"
    fam.write_text(yaml.safe_dump({
        "name": "tiny", "base": str(Path(FAMILY).resolve().parent / "quick.yaml"),
        "engines": [2, 3], "profiles": ["h100-8b"], "kv_tokens": [40000, 60000],
        "group_size": {"rlvr": [1, 4], "rlhf": [1, 2], "agentic": [1, 2]},
        "turns_median": [2, 3], "inflight_per_engine": [4, 8], "batch_size": [8, 16],
        "turnovers": 1, "sync_steps": 2, "loops": ["sync", "async-fifo"]}))
    out = tmp_path / "fam.json"
    res = CliRunner().invoke(app, ["bench", "--family", str(fam), "--samples", "2", "--seed", "1",
                                   "--policies", "least_loaded,cache_aware,misa_t",
                                   "--json", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert len(report["scenarios"]) == 2
    for sc in report["scenarios"]:
        best = max(sc["ratios"][n]["x_best"] for n in ("least_loaded", "cache_aware"))
        assert best == pytest.approx(1.0)  # ratios are to the best baseline of the scenario
        assert all(0 < sc["ratios"][n]["of_bound"] < 1 for n in sc["ratios"])
        # cold and start-up ratios are to the best baseline in that phase
        for key in ("x_best_cold", "start_up_speed", "first_tenth_speed", "run_speed"):
            assert max(sc["ratios"][n][key] for n in ("least_loaded", "cache_aware")) == \
                pytest.approx(1.0)
    s = report["summary"]["misa_t"]
    xs = [sc["ratios"]["misa_t"]["x_best"] for sc in report["scenarios"]]
    assert s["min_x_best"] == min(xs)
    assert s["geomean_x_best"] == pytest.approx((xs[0] * xs[1]) ** 0.5)
    # The bound's ceiling on ×best: the inverse of the best baseline's share of the bound, and
    # above what every policy reached.
    ceilings = []
    for sc in report["scenarios"]:
        room = sc["headroom"]
        best = room["best_baseline"]
        assert sc["ratios"][best]["x_best"] == pytest.approx(1.0)
        assert room["bound_x_best"] == pytest.approx(1 / sc["ratios"][best]["of_bound"])
        assert all(sc["ratios"][n]["x_best"] < room["bound_x_best"] for n in sc["ratios"])
        ceilings.append(room["bound_x_best"])
    assert report["headroom"]["min_bound_x_best"] == min(ceilings)
    assert report["headroom"]["geomean_bound_x_best"] == pytest.approx(
        (ceilings[0] * ceilings[1]) ** 0.5)


def test_the_headroom_summary_splits_out_the_contended_scenarios():
    rooms = [{"bound_x_best": 1.1, "preemptions_per_session": 0.5},
             {"bound_x_best": 4.0, "preemptions_per_session": 0.0},
             {"bound_x_best": 1.6, "preemptions_per_session": 0.02},
             None]
    h = summarize_headroom(rooms, contended_above=0.01)
    assert h["scenarios"] == 3 and h["min_bound_x_best"] == 1.1
    assert h["geomean_bound_x_best"] == pytest.approx((1.1 * 4.0 * 1.6) ** (1 / 3))
    assert h["contended"] == 2
    assert h["contended_min_bound_x_best"] == 1.1
    assert h["contended_geomean_bound_x_best"] == pytest.approx((1.1 * 1.6) ** 0.5)


def test_headroom_taken_is_the_share_of_the_geometric_mean_headroom_where_there_is_room():
    rooms = [{"bound_x_best": 1.5}, {"bound_x_best": 2.0}, {"bound_x_best": 1.1}, None]
    rows = [{"p": {"x_best": 1.2}}, {"p": {"x_best": 0.9}}, {"p": {"x_best": 1.05}},
            {"p": {"x_best": 1.0}}]
    h = summarize_headroom_taken(rows, rooms, ["p"], room_above=1.2)["p"]
    assert h["scenarios"] == 2  # 1.1× leaves no room; the last has no bound
    assert h["geomean_x_best"] == pytest.approx((1.2 * 0.9) ** 0.5)
    assert h["geomean_bound_x_best"] == pytest.approx((1.5 * 2.0) ** 0.5)
    assert h["taken"] == pytest.approx(math.log((1.2 * 0.9) ** 0.5) / math.log((1.5 * 2.0) ** 0.5))
    assert summarize_headroom_taken(rows, [None] * 4, ["p"])["p"] == {"scenarios": 0,
                                                                       "room_above": 1.2}


def test_a_sweep_reports_each_points_bound_and_headroom(tmp_path):
    out = tmp_path / "sweep.json"
    res = CliRunner().invoke(app, ["bench", "--scenario", str(Path(FAMILY).resolve().parent / "quick.yaml"),
                                   "--sweep", "trainer.inflight_bound=32,64",
                                   "--policies", "least_loaded,cache_aware,misa_t",
                                   "--json", str(out)])
    assert res.exit_code == 0, res.output
    points = json.loads(out.read_text())["points"]
    assert [p["value"] for p in points] == [32, 64]
    for p in points:
        tok = {n: p["policies"][n]["metrics"]["tokens_per_s"] for n in ("least_loaded", "cache_aware")}
        assert p["headroom"]["best_baseline"] == max(tok, key=tok.get)
        assert p["headroom"]["bound_x_best"] == pytest.approx(
            p["bound"]["tokens_per_s"] / max(tok.values()))
        assert all(p["policies"][n]["metrics"]["tokens_per_s"] < p["bound"]["tokens_per_s"]
                   for n in p["policies"])


def test_bench_options_are_checked_before_anything_runs():
    runner = CliRunner()
    res = runner.invoke(app, ["bench", "--policies", "misa_t"])
    assert res.exit_code == 2 and "give exactly one of --scenario and --family" in res.output
    res = runner.invoke(app, ["bench", "--scenario", "scenarios/quick.yaml", "--jobs", "0"])
    assert res.exit_code == 2 and "jobs: 0 must be at least 1" in res.output
    res = runner.invoke(app, ["bench", "--family", FAMILY, "--sweep", "trainer.inflight_bound=1"])
    assert res.exit_code == 2 and "sweep: needs --scenario" in res.output
    res = runner.invoke(app, ["bench", "--scenario", "scenarios/quick.yaml",
                              "--scheduling-policy", "priority"])
    assert res.exit_code == 2 and "scheduling-policy: needs --family" in res.output
    res = runner.invoke(app, ["bench", "--family", FAMILY, "--samples", "1",
                              "--scheduling-policy", "lifo"])
    assert res.exit_code == 2 and "scheduling_policy: 'lifo' is not 'fcfs' or 'priority'" \
        in res.output
