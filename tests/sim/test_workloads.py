import dataclasses

import numpy as np
import pytest

from broker.policies import base
from broker.session import Session
from sim.scenario import parse_scenario
from sim.workloads import SessionTruth, SimSession, generate_group
from sim.workloads.source import GeneratedSource


def _scenario(seed=1, **workloads):
    workloads = workloads or {"rlvr": {}, "rlhf": {}, "agentic": {}}
    share = 1 / len(workloads)
    return parse_scenario({
        "name": "t", "seed": seed, "fleet": {"engines": 1, "profile": "h100-8b"},
        "workloads": workloads, "mixture": {w: share for w in workloads},
        "trainer": {"iterations": 1, "batch_size": 8, "inflight_bound": 64},
    })


def test_same_seed_same_sessions_other_seed_differs():
    a, b, c = _scenario(1), _scenario(1), _scenario(2)
    for w in ("rlvr", "rlhf", "agentic"):
        assert generate_group(a, w, 3) == generate_group(b, w, 3)
        assert generate_group(a, w, 3) != generate_group(c, w, 3)


def test_group_content_does_not_depend_on_draw_order():
    sc = _scenario()
    src = GeneratedSource(sc)
    for _ in range(3):
        src.next_group("rlhf")
    first_rlvr = src.next_group("rlvr")
    assert first_rlvr == generate_group(sc, "rlvr", 0)


def test_rlvr_group_shares_prompt_and_ids_are_unique():
    g = generate_group(_scenario(), "rlvr", 0)
    assert len(g) == 16
    assert len({tuple(s.session.prompt_token_ids) for s in g}) == 1
    assert len({s.session_id for s in g}) == 16
    assert {s.session.group_id for s in g} == {"rlvr-g000000"}
    assert all(s.session.group_size == 16 and s.truth.turns == 1 for s in g)


def test_rlvr_lengths_follow_the_fit_and_truncate_at_the_cap():
    sc = _scenario(rlvr={"max_tokens": 16384})
    natural, capped = [], []
    for i in range(400):
        for s in generate_group(sc, "rlvr", i):
            capped.append(s.truth.output_tokens[0])
            natural.append(s.truth.truncated[0])
    out = np.array(capped)
    # 6,400 draws of LN(4,000, 0.78): median 4,000 (±5%); P(> 16,384) ≈ 3.5% (WORKLOADS: 3.9% @0.8).
    assert 3800 < np.median(out) < 4200
    assert out.max() == 16384
    assert 0.02 < np.mean(natural) < 0.05
    assert np.all((out == 16384) == np.array(natural))


def test_rlvr_groups_are_correlated_by_the_per_prompt_factor():
    sc = _scenario(rlvr={})
    logs = np.array([[np.log(s.truth.output_tokens[0]) for s in generate_group(sc, "rlvr", i)]
                     for i in range(300)])
    # Between-group variance of group means ≈ 0.5² + 0.6²/16 = 0.27; within ≈ 0.36.
    assert 0.18 < logs.mean(axis=1).var() < 0.36
    assert 0.28 < logs.var(axis=1, ddof=1).mean() < 0.44


def test_rlhf_prompt_and_response_caps():
    sc = _scenario(rlhf={"group_size": 3})
    sessions = [s for i in range(300) for s in generate_group(sc, "rlhf", i)]
    assert all(len(s.session.prompt_token_ids) <= 1024 for s in sessions)
    assert max(s.truth.output_tokens[0] for s in sessions) == 1024
    med = np.median([s.truth.output_tokens[0] for s in sessions])
    assert 260 < med < 340


def test_agentic_structure():
    sc = _scenario(agentic={"task_families": 2})
    spec = sc.workloads["agentic"]
    groups = [generate_group(sc, "agentic", i) for i in range(40)]
    system = {}
    for g in groups:
        prompts = {tuple(s.session.prompt_token_ids) for s in g}
        assert len(prompts) == 1  # the task prompt is shared by the group's trajectories
        family = g[0].session.metadata["task_family"]
        system.setdefault(family, set()).add(prompts.pop()[: spec.system_prompt_tokens])
        for s in g:
            t = s.truth
            assert 1 <= t.turns <= 50 and s.session.max_turns == 50
            assert len(t.tool_latency_s) == len(t.observation_tokens) == t.turns - 1
            assert all(0 < x <= 120 for x in t.tool_latency_s)
            assert all(1 <= n <= 16384 for n in t.observation_tokens)
            assert 0 < t.final_latency_s <= 900
            last = s.turn_prompt_tokens(t.turns - 1)
            assert last + spec.max_tokens <= spec.max_context_tokens
    assert all(len(v) == 1 for v in system.values())  # one system prompt per family
    assert len(system) == 2


def test_agentic_turns_without_context_limit_follow_the_fit():
    sc = _scenario(agentic={"max_context_tokens": 10_000_000, "observation": {"median": 1, "sigma": 0}})
    turns = [s.truth.turns for i in range(200) for s in generate_group(sc, "agentic", i)]
    assert min(turns) >= 3 and max(turns) == 50
    assert 25 <= np.median(turns) <= 31  # LN(28, 0.75)
    assert 0.17 < np.mean(np.array(turns) == 50) < 0.27  # WORKLOADS: 22% hit a 50 cap


def test_follow_up_prompt_extends_the_previous_one():
    s = next(s for s in generate_group(_scenario(), "agentic", 0) if s.truth.turns >= 3)
    p1, p2 = s.turn_prompt(1), s.turn_prompt(2)
    assert p2[: len(p1)] == p1
    assert len(p2) == s.turn_prompt_tokens(2)
    obs = s.truth.observation_token_ids(1)
    assert p2[-len(obs):] == obs
    assert s.truth.observation_token_ids(1) == obs  # deterministic
    assert s.truth.observation_token_ids(0) != s.truth.observation_token_ids(1)[: len(s.truth.observation_token_ids(0))]
    assert all(0 <= t < s.truth.vocab_size for t in obs)


def test_truth_invariants_are_checked():
    ok = dict(output_tokens=(5, 6), truncated=(False, False), tool_latency_s=(1.0,),
              observation_tokens=(3,), final_latency_s=0.0, token_seed=1, vocab_size=100)
    SessionTruth(**ok)
    with pytest.raises(ValueError, match="tool_latency_s: needs 1"):
        SessionTruth(**{**ok, "tool_latency_s": ()})
    with pytest.raises(ValueError, match="at least 1 token"):
        SessionTruth(**{**ok, "output_tokens": (0, 6)})
    session = Session(session_id="s", workload="rlvr", prompt_token_ids=[1, 2], max_tokens=5)
    with pytest.raises(ValueError, match="max_turns"):
        SimSession(session=session, truth=SessionTruth(**ok))


TRUTH_FIELDS = {f.name for f in dataclasses.fields(SessionTruth)}


@pytest.mark.parametrize("cls", [base.PendingItem, base.ResidentSession, base.BackendView,
                                 base.Snapshot, base.Telemetry])
def test_policy_snapshot_types_have_no_truth_fields(cls):
    assert not TRUTH_FIELDS & {f.name for f in dataclasses.fields(cls)}


def test_public_session_has_no_truth_fields():
    assert not TRUTH_FIELDS & set(Session.model_fields)
    with pytest.raises(ValueError):
        Session(session_id="s", workload="rlvr", prompt_token_ids=[1], max_tokens=4, output_tokens=(3,))
