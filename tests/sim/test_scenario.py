from pathlib import Path

import pytest

from sim.scenario import AgenticSpec, RlvrSpec, ScenarioError, load_scenario, parse_scenario

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"


def _base(**over):
    data = {
        "name": "t",
        "seed": 1,
        "fleet": {"engines": 2, "profile": "h100-8b"},
        "workloads": {"rlvr": {"group_size": 4}, "rlhf": {}},
        "mixture": {"rlvr": 0.6, "rlhf": 0.4},
        "trainer": {"iterations": 2, "batch_size": 8, "inflight_bound": 16},
    }
    data.update(over)
    return data


@pytest.mark.parametrize("path", sorted(p for p in SCENARIOS.glob("*.yaml")
                                         if p.name != "family.yaml"), ids=lambda p: p.name)
def test_shipped_scenarios_load(path):
    s = load_scenario(path)
    assert abs(sum(s.mixture.values()) - 1) < 1e-9
    assert set(s.mixture) == set(s.workloads)


def test_paper_mixed_matches_the_issue():
    s = load_scenario(SCENARIOS / "paper-mixed.yaml")
    assert (s.fleet.engines, s.fleet.profile) == (8, "h200-30b-a3b-fp8")
    assert (s.fleet.max_num_batched_tokens, s.fleet.max_num_seqs) == (32768, 256)
    assert s.mixture == {"rlvr": 0.5, "rlhf": 0.3, "agentic": 0.2}
    assert s.trainer.iterations == 50


def test_kind_defaults_to_key_and_defaults_are_the_fits():
    s = parse_scenario(_base())
    rlvr = s.workloads["rlvr"]
    assert isinstance(rlvr, RlvrSpec) and rlvr.group_size == 4
    assert (rlvr.output_median, rlvr.prompt_sigma, rlvr.within_group_sigma) == (4000, 0.5, 0.6)
    assert s.workloads["rlhf"].output.median == 300


def test_custom_name_with_kind():
    s = parse_scenario(_base(workloads={"math": {"kind": "rlvr"}, "swe": {"kind": "agentic"}},
                             mixture={"math": 0.5, "swe": 0.5}))
    assert isinstance(s.workloads["swe"], AgenticSpec) and s.max_turns("swe") == 50
    assert s.max_turns("math") == 1


def _error(tmp_path, text):
    p = tmp_path / "scenario.yaml"
    p.write_text(text)
    with pytest.raises(ScenarioError) as exc:
        load_scenario(p)
    return str(exc.value)


def test_error_names_the_field_path(tmp_path):
    text = (SCENARIOS / "quick.yaml").read_text().replace("group_size: 8", "group_size: 0")
    assert "scenario.yaml: workloads.rlvr.group_size: must be ≥ 1" in _error(tmp_path, text)


def test_unknown_field_is_an_error(tmp_path):
    text = (SCENARIOS / "quick.yaml").read_text().replace("mode: fifo", "mode: fifo\n  modee: x")
    assert "scenario.yaml: trainer.modee: unknown field" in _error(tmp_path, text)


def test_bad_mode_lists_choices(tmp_path):
    text = (SCENARIOS / "quick.yaml").read_text().replace("mode: fifo", "mode: lifo")
    msg = _error(tmp_path, text)
    assert msg.startswith("scenario.yaml: trainer.mode:") and "fifo" in msg and "quota" in msg


def test_yaml_syntax_error_has_the_line(tmp_path):
    msg = _error(tmp_path, "name: x\nseed: 1\nfleet: {engines: 2\n")
    assert msg.startswith("scenario.yaml:4: YAML syntax error")


def test_mixture_must_sum_to_one():
    with pytest.raises(ScenarioError, match="mixture: shares must sum to 1"):
        parse_scenario(_base(mixture={"rlvr": 0.6, "rlhf": 0.6}))


def test_mixture_keys_must_match_workloads():
    with pytest.raises(ScenarioError, match="mixture: keys"):
        parse_scenario(_base(mixture={"rlvr": 1.0}))


def test_inflight_bound_must_hold_a_group():
    with pytest.raises(ScenarioError, match="trainer.inflight_bound"):
        parse_scenario(_base(trainer={"iterations": 1, "batch_size": 8, "inflight_bound": 2}))


def test_agentic_context_must_hold_the_first_turn():
    with pytest.raises(ScenarioError, match="workloads.agentic: .*max_context_tokens"):
        parse_scenario(_base(workloads={"agentic": {"max_context_tokens": 4000}},
                             mixture={"agentic": 1.0}))


def test_trace_source_needs_a_path_and_no_workloads():
    with pytest.raises(ScenarioError, match="trace: required"):
        parse_scenario(_base(source="trace", workloads={}))
    with pytest.raises(ScenarioError, match="'recorded' needs source 'trace'"):
        parse_scenario(_base(trainer={"iterations": 1, "batch_size": 8, "inflight_bound": 16,
                                      "arrival": "recorded"}))


def test_missing_file_is_a_scenario_error(tmp_path):
    with pytest.raises(ScenarioError, match="nope.yaml: cannot read"):
        load_scenario(tmp_path / "nope.yaml")
