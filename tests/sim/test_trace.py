import json

import pytest

from broker.policies import make_policy
from sim.fleet import FleetSim
from sim.metrics import Trainer
from sim.scenario import load_scenario, parse_scenario
from sim.trace import TraceError, _line, read_trace, with_arrivals, write_trace
from sim.workloads import generate_group
from sim.workloads.source import TraceSource, make_source


def _sessions():
    sc = parse_scenario({
        "name": "t", "seed": 5, "fleet": {"engines": 1, "profile": "h100-8b"},
        "workloads": {"rlvr": {"group_size": 2}, "agentic": {"group_size": 2}},
        "mixture": {"rlvr": 0.5, "agentic": 0.5},
        "trainer": {"iterations": 1, "batch_size": 4, "inflight_bound": 8},
    })
    return [s for i in range(2) for w in ("rlvr", "agentic") for s in generate_group(sc, w, i)]


def test_round_trip_is_exact(tmp_path):
    sessions = _sessions()
    stamped = with_arrivals(sessions, {s.session_id: 0.1 * i for i, s in enumerate(sessions)})
    path = tmp_path / "t.jsonl"
    assert write_trace(path, stamped) == len(stamped)
    back = read_trace(path)
    assert back == stamped
    write_trace(tmp_path / "u.jsonl", back)
    assert (tmp_path / "u.jsonl").read_bytes() == path.read_bytes()


def _write_lines(tmp_path, lines):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _good_line():
    return json.loads(_line(_sessions()[0]))


def test_bad_json_names_the_line(tmp_path):
    path = _write_lines(tmp_path, [json.dumps(_good_line()), "{not json"])
    with pytest.raises(TraceError, match=r"^bad.jsonl:2: not JSON"):
        read_trace(path)


def test_bad_field_names_line_and_field(tmp_path):
    line = _good_line()
    line["session"]["max_tokens"] = -1
    path = _write_lines(tmp_path, ["", json.dumps(line)])
    with pytest.raises(TraceError, match=r"^bad.jsonl:2: session.max_tokens: must be a positive"):
        read_trace(path)


def test_inconsistent_truth_names_line_and_field(tmp_path):
    line = _good_line()
    line["truth"]["tool_latency_s"] = [1.0]
    path = _write_lines(tmp_path, [json.dumps(line)])
    with pytest.raises(TraceError, match=r"^bad.jsonl:1: truth.tool_latency_s: needs 0 entries"):
        read_trace(path)


def test_duplicate_session_ids_are_rejected(tmp_path):
    path = _write_lines(tmp_path, [json.dumps(_good_line())] * 2)
    with pytest.raises(TraceError, match=r"^bad.jsonl:2: session.session_id: duplicate"):
        read_trace(path)


def test_trace_source_keeps_groups_together():
    src = TraceSource(_sessions())
    g = src.next_group("rlvr")
    assert [s.session_id for s in g] == ["rlvr-g000000-000", "rlvr-g000000-001"]
    assert src.next_group("rlvr")[0].session_id == "rlvr-g000001-000"
    assert src.next_group("rlvr") is None


def test_trace_scenario_replays_recorded_arrivals(tmp_path):
    sessions = _sessions()
    write_trace(tmp_path / "prod.jsonl",
                with_arrivals(sessions, {s.session_id: float(i) for i, s in enumerate(sessions)}))
    (tmp_path / "replay.yaml").write_text(
        "name: replay\nseed: 0\nfleet: {engines: 1, profile: h100-8b}\nsource: trace\n"
        "trace: prod.jsonl\nmixture: {rlvr: 0.5, agentic: 0.5}\n"
        "trainer: {iterations: 1, batch_size: 4, inflight_bound: 8, arrival: recorded}\n")
    sc = load_scenario(tmp_path / "replay.yaml")
    trainer = Trainer.from_scenario(sc, make_source(sc, tmp_path / "replay.yaml"))
    assert [s.session_id for s in trainer.enqueue(1.5)] == [s.session_id for s in sessions[:2]]
    assert trainer.next_arrival_at() == 2.0
    assert len(trainer.enqueue(100.0)) == len(sessions) - 2
    assert trainer.next_arrival_at() is None


def test_fleet_enqueues_recorded_arrivals_at_their_time(tmp_path):
    """A group arriving long after the first finished is enqueued at its own time, and the run
    completes (it used to wait for a result that could no longer come)."""
    sessions = _sessions()
    late = {s.session_id: (0.0 if s.session.metadata["group_index"] == 0 else 500.0)
            for s in sessions}
    write_trace(tmp_path / "prod.jsonl", with_arrivals(sessions, late))
    (tmp_path / "replay.yaml").write_text(
        "name: replay\nseed: 0\nfleet: {engines: 1, profile: h200-30b-a3b}\nsource: trace\n"
        "trace: prod.jsonl\nmixture: {rlvr: 0.5, agentic: 0.5}\n"
        "trainer: {iterations: 2, batch_size: 4, inflight_bound: 8, arrival: recorded}\n")
    sc = load_scenario(tmp_path / "replay.yaml")
    sim = FleetSim(sc, make_policy("least_loaded"), make_source(sc, tmp_path / "replay.yaml"))
    result = sim.run()
    assert sorted(at for _, at in sim.enqueued) == [0.0] * 4 + [500.0] * 4
    assert result.completed and len(result.iterations) == 2
