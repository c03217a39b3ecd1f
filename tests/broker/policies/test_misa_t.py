"""MISA-T mechanisms, each in isolation on tiny hand-built snapshots."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import broker.policies.base as base
from broker.policies import make_policy
from broker.policies.base import (
    BackendView,
    Completion,
    PendingItem,
    ResidentSession,
    Snapshot,
    Telemetry,
)
from broker.policies.misa_t import MisaT, MisaTConfig
from broker.policies.misa_t_control import AimdParams, CompletionPacer, admissible, shares
from broker.policies.misa_t_predictors import RatioWindow, TailWindow
from broker.policies.misa_t_prefix import PrefixIndex, prefix_key

CAP = 100_000


def pending(sid, *, workload="rlhf", prompt=100, max_tokens=1000, group=None, size=1,
            prefix=None, max_turns=1, turn=0, home=None, at=0.0) -> PendingItem:
    return PendingItem(
        session_id=sid, workload=workload, group_id=group, group_size=size,
        prompt_tokens=prompt, prefix=prefix if prefix is not None else tuple(range(prompt)),
        max_tokens=max_tokens, max_turns=max_turns, turn=turn, home_backend=home, enqueued_at=at,
    )


def resident(sid, *, workload="rlhf", reserved=1000, prompt=100, context=100, generated=0,
             turn=1, max_tokens=1000, max_turns=1, parked=False) -> ResidentSession:
    return ResidentSession(
        session_id=sid, workload=workload, group_id=None, reserved_tokens=reserved,
        prompt_tokens=prompt, context_tokens=context, generated_tokens=generated, turn=turn,
        max_tokens=max_tokens, max_turns=max_turns, waiting_on_tool=parked, admitted_at=0.0,
    )


def hb(at, *, usage=0.5, waiting=0, preemptions=0) -> Telemetry:
    return Telemetry(at=at, kv_usage=usage, running=1, waiting=waiting,
                     preemptions_total=preemptions, prefix_queries_total=0, prefix_hits_total=0)


def view(bid, *sessions, alpha=1.0, telemetry=None, capacity=CAP) -> BackendView:
    return BackendView(backend_id=bid, capacity_tokens=capacity, max_model_len=capacity,
                       healthy=True, alpha=alpha, telemetry=telemetry, sessions=tuple(sessions))


def snap(backends, items=(), *, now=0.0, target=None, consumed=None, done=()) -> Snapshot:
    by_w: dict[str, list[PendingItem]] = {}
    for it in items:
        by_w.setdefault(it.workload, []).append(it)
    return Snapshot(now=now, pending={w: tuple(v) for w, v in by_w.items()},
                    backends=tuple(backends), mixture_target=target or {"rlhf": 1.0},
                    consumed=consumed or {}, new_completions=tuple(done))


def completion(sid, *, workload="rlhf", out=500, turns=1, tool_wait=0.0, kv_s=1e5,
               duration=1.0) -> Completion:
    return Completion(session_id=sid, workload=workload, backend_id="a", prompt_tokens=100,
                      output_tokens=out * turns, turn_output_tokens=(out,) * turns, turns=turns,
                      tool_wait_s=tool_wait, kv_token_seconds=kv_s, admitted_at=0.0,
                      finished_at=duration, truncated=False)


# -- adaptive admission (AIMD) ---------------------------------------------------------------

def test_aimd_backs_off_on_a_preemption() -> None:
    policy = make_policy("misa_t", open_single_turn=False)  # (the loop, on single-turn sessions)
    full = resident("r", reserved=95_000)
    policy.decide(snap([view("a", full, telemetry=hb(1.0, preemptions=3))]))
    before = policy.alpha_loop.alpha["a"]
    d = policy.decide(snap([view("a", full, alpha=before, telemetry=hb(2.0, preemptions=4))]))
    assert d.alpha["a"] == pytest.approx(before * AimdParams().backoff_preempt)


def test_alpha_grows_toward_the_ceiling_only_while_it_binds_usage_is_low_and_work_waits() -> None:
    p = AimdParams()
    low = hb(2.0, usage=0.5)
    ratio = 0.5  # the engine holds half of what the ledger charges: the ceiling is 0.95/0.5
    ceiling = p.kv_target / ratio

    def step(alpha=1.0, now=low, before=None, **kw):
        args = {"next_charge": 1_000, "reserved": 95_000, "capacity": CAP, "ratio": ratio} | kw
        return p.step(alpha, now, before or hb(1.0), **args)

    assert step() == pytest.approx(1.0 + p.approach * (ceiling - 1.0))
    # not after a recent back-off (the calm clock), not without work, not while α has slack,
    # not before any ratio is known, and never past the ceiling
    busy = hb(2.0, usage=p.recovered_kv + 0.05)
    assert step(now=busy, calm_for=p.calm_s / 2) == 1.0
    assert step(next_charge=None) == 1.0
    assert step(reserved=10_000) == 1.0
    # α binds too when the smallest waiting session no longer fits under α·C, however far
    # the reservations are from the binding fraction (three sessions of 26% of C leave 22%)
    assert step(reserved=78_000, next_charge=26_000) > 1.0
    assert step(reserved=78_000, next_charge=20_000) == 1.0
    assert step(ratio=None) == 1.0
    assert step(alpha=ceiling, reserved=CAP * 2) == pytest.approx(ceiling)
    assert step(alpha=2.5, reserved=CAP * 3) == 2.5  # above the ceiling: the signals bring it down
    hot = hb(2.0, usage=p.kv_high + 0.005)
    assert step(now=hot, reserved=CAP) == pytest.approx(p.backoff_high)
    queue = hb(2.0, waiting=9)
    assert step(now=queue, before=hb(1.0, waiting=5), reserved=CAP) == pytest.approx(p.backoff_waiting)
    assert step(alpha=p.alpha_min, now=queue, before=hb(1.0, waiting=5)) == p.alpha_min


def test_a_back_off_stops_at_what_the_engine_held() -> None:
    """Anti-windup: a signal says the reservations R_b the engine held were too much, so α
    comes down by the factor but not below factor·R_b/C_b. Where R_b is above α·C_b
    (admission already closed; the engine still works through what it took), shrinking α on
    every beat of that congestion wound it down to alpha_min, and the engine idled once the
    congestion cleared."""
    p = AimdParams()
    hot = hb(2.0, usage=p.kv_high + 0.005)

    def step(alpha, reserved, now=hot, before=None):
        return p.step(alpha, now, before or hb(1.0), next_charge=1_000, reserved=reserved,
                      capacity=CAP, ratio=0.5)

    assert step(1.5, 2 * CAP) == 1.5  # closed already: α holds, beat after beat
    assert step(1.5, 1.52 * CAP) == pytest.approx(1.52 * p.backoff_high)  # part of the way
    assert step(1.5, CAP) == pytest.approx(1.5 * p.backoff_high)  # α binds: the factor
    queue = hb(2.0, waiting=9)
    assert step(1.5, 3 * CAP, now=queue, before=hb(1.0, waiting=5)) == 1.5
    assert step(1.5, CAP, now=queue, before=hb(1.0, waiting=5)) == pytest.approx(
        1.5 * p.backoff_waiting)


def test_alpha_grows_at_once_where_the_engine_has_drained_since_its_last_back_off() -> None:
    """The calm period keeps α from growing back into the congestion it just backed off from;
    once the engine holds less than `recovered_kv` with nothing queued (the cohort that filled
    it has finished), waiting it out only leaves KV idle while sessions wait."""
    p = AimdParams()
    ratio = 0.5

    def step(now, calm_for=0.0):
        return p.step(1.0, now, hb(1.0), next_charge=1_000, reserved=95_000, capacity=CAP,
                      ratio=ratio, calm_for=calm_for)

    grown = 1.0 + p.approach * (p.kv_target / ratio - 1.0)
    assert step(hb(2.0, usage=p.recovered_kv - 0.05)) == pytest.approx(grown)
    # still busy: the calm clock holds α where it is
    assert step(hb(2.0, usage=p.recovered_kv + 0.05)) == 1.0
    assert step(hb(2.0, usage=0.3, waiting=2)) == 1.0  # a queue within tolerance: not drained
    assert step(hb(2.0, usage=p.recovered_kv + 0.05), calm_for=p.calm_s) == pytest.approx(grown)


def test_alpha_grows_where_sessions_are_large_against_the_cache() -> None:
    """Three sessions charged 26% of C each (prompt plus their 26,000-token cap) hold 78%: the
    fourth does not fit at α = 1, and with the engine at 30% the loop grows α until it does
    (before, α waited for reservations of 90% of α·C, which sessions this large never reach)."""
    policy = make_policy("misa_t")
    big = {"max_tokens": 25_900, "prompt": 100}
    residents = [resident(f"r{i}", reserved=26_000, context=3_000, **big) for i in range(3)]
    items = [pending(f"p{i}", at=float(i), **big) for i in range(4)]
    alpha, admitted = 1.0, []
    for t in range(1, 12):
        d = policy.decide(snap([view("a", *residents, alpha=alpha,
                                     telemetry=hb(float(t), usage=0.3))], items, now=float(t)))
        alpha = d.alpha.get("a", alpha)
        admitted += d.admissions
        residents += [resident(a.session_id, reserved=a.reserved_tokens, context=100, **big)
                      for a in d.admissions]
        items = [it for it in items if it.session_id not in {a.session_id for a in d.admissions}]
    assert alpha > 1.0
    assert admitted, "α grew past the next session's charge, and the session went in"


def test_usage_ratio_follows_what_the_engine_holds_per_token_charged() -> None:
    p = AimdParams()
    first = p.usage_ratio(None, hb(1.0, usage=0.4), reserved=80_000, capacity=CAP)
    assert first == pytest.approx(0.5)
    second = p.usage_ratio(first, hb(2.0, usage=0.8), reserved=80_000, capacity=CAP)
    assert second == pytest.approx(0.5 + p.usage_ratio_gain * (1.0 - 0.5))
    # a nearly empty ledger says nothing: the ratio stays what it was
    assert p.usage_ratio(first, hb(3.0, usage=0.01), reserved=1_000, capacity=CAP) == first
    assert p.ceiling(None) is None
    assert p.ceiling(0.5) == pytest.approx(p.kv_target / 0.5)
    assert p.ceiling(0.001) == p.alpha_max  # a guard, not a target


def test_a_cold_fleet_starts_at_the_guard_a_warm_or_loaded_one_at_the_ledgers_alpha() -> None:
    """At the start of a run (the ledger's registration α of 1, nothing reserved, no lengths
    learned: charges at the caps, 1,100 each) α starts at alpha_max, so the first call admits
    up to 4·C of cap charges; a policy that recalled an earlier run's lengths, and a backend
    that already holds reservations (a restarted broker), start from the ledger's α."""
    p = AimdParams()
    items = [pending(f"p{i}", at=float(i)) for i in range(400)]
    mix = {"rlhf": 0.5, "agentic": 0.5}  # a multi-turn workload keeps admission closed
    agentic = pending("g", workload="agentic", max_turns=4, at=500.0)

    cold = make_policy("misa_t")
    d = cold.decide(snap([view("a")], [*items, agentic], target=mix))
    assert d.alpha["a"] == p.alpha_max
    charged = sum(a.reserved_tokens for a in d.admissions)
    assert 3 * CAP < charged <= p.alpha_max * CAP

    warm = make_policy("misa_t")
    warm.recall([completion(f"c{i}", out=100) for i in range(32)])
    d = warm.decide(snap([view("a")], [*items, agentic], target=mix))
    assert d.alpha.get("a", 1.0) == 1.0
    assert sum(a.reserved_tokens for a in d.admissions) <= CAP

    restarted = make_policy("misa_t")
    d = restarted.decide(snap([view("a", resident("r", reserved=50_000))],
                              [*items, agentic], target=mix))
    assert d.alpha.get("a", 1.0) == 1.0
    assert 50_000 + sum(a.reserved_tokens for a in d.admissions) <= CAP


def test_alpha_overbooks_until_the_engine_reports_its_target_usage() -> None:
    """Reservations twice what the engine holds: α rises to about kv_target/ρ (1.94), far past
    1, and admissions follow; the same engine at 95% never lets α grow."""
    policy = make_policy("misa_t", residency_accounting=False,  # static charges of 1,100
                         open_single_turn=False)
    residents = [resident("r", reserved=95_000)]
    items = [pending(f"p{i}", at=float(i)) for i in range(400)]
    alpha = 1.0
    for t in range(1, 60):
        reserved = sum(r.reserved_tokens for r in residents)
        usage = 0.5 * reserved / CAP  # the engine holds half of every charge
        d = policy.decide(snap([view("a", *residents, alpha=alpha,
                                     telemetry=hb(float(t), usage=usage))], items))
        alpha = d.alpha.get("a", alpha)
        residents += [resident(a.session_id, reserved=a.reserved_tokens) for a in d.admissions]
        items = items[len(d.admissions):]
    target = AimdParams().kv_target / 0.5
    assert alpha == pytest.approx(target, rel=0.02)
    assert sum(r.reserved_tokens for r in residents) > 1.8 * CAP
    exact = make_policy("misa_t", residency_accounting=False, open_single_turn=False)
    alpha = 0.95
    for t in range(1, 30):  # what it charges is exactly what the engine holds: ρ = 1
        d = exact.decide(snap([view("a", resident("r", reserved=95_000), alpha=alpha,
                                    telemetry=hb(float(t), usage=0.95))], items))
        alpha = d.alpha.get("a", alpha)
        assert alpha <= AimdParams().kv_target
    d = make_policy("misa_t-admission", residency_accounting=False).decide(
        snap([view("a", *residents, alpha=1.3, telemetry=hb(1.0, usage=0.3))], items))
    assert d.alpha == {"a": 1.0} and d.admissions == []


def learned(policy, *, workload="rlhf", max_turns=1, ratio=0.5, n=16, turns=1) -> None:
    """n sessions admitted at t=0 at the cap (charge 1,100, nothing learned yet), finished at
    t=10 holding `ratio` of that charge over their residency (kv_token_seconds). They run on
    backend "w", which the callers' own steps leave alone: a backend first seen while nothing
    is learned starts at the guard (the cold start), one first seen after it at the ledger's α."""
    items = [pending(f"l{i}", workload=workload, max_turns=max_turns) for i in range(n)]
    d = policy.decide(snap([view("w")], items, target={workload: 1.0}))
    assert [a.reserved_tokens for a in d.admissions] == [1100] * n
    done = [completion(f"l{i}", workload=workload, turns=turns, duration=10.0,
                       kv_s=ratio * 1100 * 10.0) for i in range(n)]
    policy.decide(snap([view("w")], now=10.0, done=done, target={workload: 1.0}))


def test_held_per_charged_is_learned_from_single_turn_sessions_over_their_residency() -> None:
    policy = make_policy("misa_t")
    learned(policy, ratio=0.5, n=15)
    assert policy.predictions.models["rlhf"].held_per_charged.ratio() is None  # 15 < min_samples
    learned(policy, ratio=0.5, n=1)
    assert policy.predictions.models["rlhf"].held_per_charged.ratio() == pytest.approx(0.5)
    agentic = make_policy("misa_t")  # multi-turn: the context jumps between heartbeats
    learned(agentic, workload="agentic", max_turns=3, turns=2)
    assert agentic.predictions.models["agentic"].held_per_charged.ratio() is None
    restarted = make_policy("misa_t")  # sessions it did not admit have no charge history
    restarted.decide(snap([view("a", *[resident(f"l{i}") for i in range(16)],
                                telemetry=hb(5.0))], [pending("x")]))
    restarted.decide(snap([view("a")], [pending("y")], now=10.0,
                          done=[completion(f"l{i}", duration=10.0) for i in range(16)]))
    assert restarted.predictions.models["rlhf"].held_per_charged.ratio() is None


def test_the_charge_integral_is_what_the_ledger_charged_a_refused_growth_not_counted() -> None:
    policy = make_policy("misa_t")
    learned(policy, ratio=0.5)  # 16 sessions: 5,500 held per 11,000 charged
    (a,) = policy.decide(snap([view("a")], [pending("s")], now=11.0)).admissions
    assert a.reserved_tokens == 600
    past = resident("s", reserved=600, context=700, generated=600)  # past every sample seen
    d = policy.decide(snap([view("a", past, telemetry=hb(12.0))], [pending("x")], now=12.0))
    assert d.recharge == {"s": 1100}  # the cap: the tail above 600 is unknown
    # the ledger refuses the growth (no room under α·C): the next heartbeat still says 600
    policy.decide(snap([view("a", past, telemetry=hb(13.0))], [pending("x")], now=13.0))
    charged = 600 * 1.0 + 1100 * 1.0 + 600 * 7.0  # until the heartbeat that shows the refusal
    policy.decide(snap([view("a")], [pending("y")], now=20.0,
                       done=[completion("s", duration=20.0, kv_s=charged)]))
    ratio = policy.predictions.models["rlhf"].held_per_charged.ratio()
    assert ratio == pytest.approx((16 * 5500 + charged) / (16 * 11000 + charged))


def grow_alpha(policy, *, context: int, steps: int = 60) -> float:
    """Heartbeats of one backend whose residents all hold `context` tokens (the engine's usage
    is their sum), with work pending: the α the loop reaches."""
    residents: list = []
    items = [pending(f"p{i}", at=float(i)) for i in range(3000)]
    alpha = 1.0
    for t in range(11, 11 + steps):
        usage = sum(r.context_tokens for r in residents) / CAP
        d = policy.decide(snap([view("a", *residents, alpha=alpha,
                                     telemetry=hb(float(t), usage=usage))], items, now=float(t)))
        alpha = d.alpha.get("a", alpha)
        charges = {r.session_id: d.recharge.get(r.session_id, r.reserved_tokens) for r in residents}
        residents = [dataclasses.replace(r, reserved_tokens=charges[r.session_id]) for r in residents]
        residents += [resident(a.session_id, reserved=a.reserved_tokens, context=context,
                               generated=context - 100) for a in d.admissions]
        items = items[len(d.admissions):]
    return alpha


def test_young_residents_scale_the_usage_ratio_by_how_much_more_they_will_hold() -> None:
    """Finished sessions held half of their charge over their residency; residents that hold a
    fifth of it are young and will grow: the loop's ceiling is kv_target / (ρ·2.5) = 1.94
    (what the engine would hold once they have), where the measured ρ alone puts it past
    the guard of 4. Residents already holding more than half say nothing more than ρ does."""
    p = AimdParams()
    anticipating = make_policy("misa_t", open_single_turn=False)
    blind = make_policy("misa_t", anticipate_growth=False, open_single_turn=False)
    for policy in (anticipating, blind):
        learned(policy, ratio=0.5)
    # after 16 completions of 500 tokens a fresh session is charged 100 + 500 = 600
    assert grow_alpha(anticipating, context=120) == pytest.approx(p.kv_target / 0.5, rel=0.02)
    assert grow_alpha(blind, context=120) == pytest.approx(p.alpha_max)
    older = make_policy("misa_t", open_single_turn=False)
    learned(older, ratio=0.5)
    assert grow_alpha(older, context=480) == pytest.approx(p.kv_target / 0.8, rel=0.02)


def test_growth_within_the_noise_of_a_few_residents_is_not_scaled() -> None:
    """With n residents the factor must pass 1 + 2/√n: 4 residents at 1.5× are noise."""
    policy = make_policy("misa_t")
    learned(policy, ratio=0.5)
    young = [resident(f"r{i}", reserved=600, context=200, generated=100) for i in range(4)]
    usage = 800 / CAP
    policy.decide(snap([view("a", *young, telemetry=hb(11.0, usage=usage))], [pending("x")],
                       now=11.0))
    assert policy.book.booked["a"].growth == 1.0
    many = [resident(f"r{i}", reserved=600, context=200, generated=100) for i in range(64)]
    policy.decide(snap([view("a", *many, telemetry=hb(12.0, usage=64 * 200 / CAP))],
                       [pending("x")], now=12.0))
    assert policy.book.booked["a"].growth == pytest.approx(0.5 * 600 / 200)


def test_growth_is_judged_by_what_the_engine_holds_not_by_the_beats_contexts() -> None:
    """A worker learns a turn's output when the turn ends: until then its beats show each
    session's prompt. Residents whose beats say 100 tokens while the engine holds 300 of each
    have grown into half of their 600 already (the learned ratio): nothing to scale. Judged by
    the contexts, the factor was 3, and on outputs of thousands of tokens it reached 40 and
    held α far below what the engine could take."""
    policy = make_policy("misa_t")
    learned(policy, ratio=0.5)
    residents = [resident(f"r{i}", reserved=600, context=100) for i in range(64)]
    policy.decide(snap([view("a", *residents, telemetry=hb(11.0, usage=64 * 300 / CAP))],
                       [pending("x")], now=11.0))
    assert policy.book.booked["a"].growth == 1.0
    # the same residents while the engine holds only their prompts: young, they will grow
    policy.decide(snap([view("a", *residents, telemetry=hb(12.0, usage=64 * 100 / CAP))],
                       [pending("x")], now=12.0))
    assert policy.book.booked["a"].growth == pytest.approx(0.5 * 600 / 100)


def test_admits_only_while_reservations_fit_alpha_times_capacity() -> None:
    # static charge prompt + max_tokens = 1,100; the ledger's α, not open admission
    policy = make_policy("misa_t-residency", open_single_turn=False)
    items = [pending(f"s{i}", at=float(i)) for i in range(200)]
    d = policy.decide(snap([view("a", alpha=0.5, capacity=10_000)], items))
    assert len(d.admissions) == 4  # 4 × 1,100 ≤ 5,000 < 5 × 1,100
    assert sum(a.reserved_tokens for a in d.admissions) <= 5_000


# -- open admission ---------------------------------------------------------------------------

def _full_backend(t: float, *, preemptions: int = 0) -> BackendView:
    """A backend whose ledger is full at α = 1 (no session of 1,100 fits) and whose engine is
    busy (a heartbeat may say it just preempted)."""
    return view("a", resident("r", reserved=99_500), telemetry=hb(t, usage=0.99,
                                                                   preemptions=preemptions))


def test_a_single_turn_mixture_is_admitted_to_the_engine_past_the_loops_alpha() -> None:
    """With no multi-turn workload nothing sits in the cache between turns for an overfull
    engine to evict: every pending session goes to the engine (its queue holds what does not
    fit) and the ledger's α is open_alpha, whatever the loop would say (here it backs off).
    Static charges (no residency accounting) keep the resident where it is."""
    items = [pending(f"p{i}", at=float(i)) for i in range(50)]
    for name, opened in (("misa_t", True), ("misa_t", False), ("misa_t-admission", True)):
        policy = make_policy(name, residency_accounting=False, open_single_turn=opened)
        first = policy.decide(snap([_full_backend(1.0, preemptions=1)], items))
        d = policy.decide(snap([_full_backend(2.0, preemptions=2)], items, now=2.0))
        if name == "misa_t" and opened:
            assert first.alpha["a"] == d.alpha.get("a", first.alpha["a"]) == MisaTConfig().open_alpha
            assert len(first.admissions) == len(d.admissions) == 50
        else:  # the loop backs off; without it (the ablation) α stays the ledger's 1
            assert first.admissions == d.admissions == []
            assert d.alpha.get("a", 1.0) < 1.0 if name == "misa_t" else "a" not in d.alpha
    # a workload of the mixture not seen yet may be multi-turn: closed until it shows
    # (and so may any workload to come when the trainer has set no mixture)
    for target in ({"rlhf": 0.8, "agentic": 0.2}, {}):
        unseen = make_policy("misa_t", residency_accounting=False)
        d = unseen.decide(Snapshot(now=0.0, pending={"rlhf": tuple(items)},
                                   backends=(_full_backend(1.0),), mixture_target=target,
                                   consumed={}, new_completions=()))
        assert d.admissions == [] and "a" not in d.alpha


def test_a_multi_turn_workload_closes_admission_for_good_where_the_ledger_stands() -> None:
    """The first multi-turn session seen closes admission, for the rest of the run: the loop's
    α then starts from the reservations (capped at alpha_max), not far below them, so the
    backend is not left to drain before it admits again. (Static charges: the residents stay
    charged what the ledger says.)"""
    p = AimdParams()
    policy = make_policy("misa_t", residency_accounting=False)
    residents = [resident(f"r{i}", reserved=10_000) for i in range(25)]  # 2.5·C charged
    full = 0.995  # the engine is full: the loop backs off by backoff_high on each heartbeat
    single = [pending(f"p{i}", at=float(i)) for i in range(5)]
    d = policy.decide(snap([view("a", *residents, telemetry=hb(1.0, usage=full))], single))
    assert d.alpha["a"] == MisaTConfig().open_alpha and len(d.admissions) == 5
    agentic = pending("g", workload="agentic", max_turns=4, at=9.0)
    mix = {"rlhf": 0.5, "agentic": 0.5}
    d = policy.decide(snap([view("a", *residents, alpha=100.0, telemetry=hb(2.0, usage=full))],
                           [*single, agentic], now=2.0, target=mix))
    assert d.admissions == []
    assert d.alpha["a"] == pytest.approx(2.5 * p.backoff_high)  # from where the ledger stands
    # gone from the queue, the multi-turn workload keeps admission closed; the engine is
    # still full, but what it holds is already above α·C: α holds (no wind-down)
    d = policy.decide(snap([view("a", *residents, alpha=d.alpha["a"],
                                 telemetry=hb(3.0, usage=full))], single, now=3.0, target=mix))
    assert d.admissions == [] and "a" not in d.alpha
    many = [resident(f"r{i}", reserved=10_000) for i in range(60)]  # 6·C: capped
    fresh = make_policy("misa_t", residency_accounting=False)
    # a restarted broker with the ledger at open_alpha, before any heartbeat reaches it
    d = fresh.decide(snap([view("a", *many, alpha=100.0)], [agentic], target=mix))
    assert d.alpha["a"] == pytest.approx(p.alpha_max) and d.admissions == []


# -- residency-time-aware accounting --------------------------------------------------------

def test_charge_follows_the_tail_given_progress() -> None:
    policy = make_policy("misa_t")
    policy.decide(snap([view("a")], [pending("warm")]))
    lengths = [100] * 80 + [4000] * 20  # most stop at 100; those past 100 go to 4,000
    policy.decide(snap([view("a")], done=[completion(f"c{i}", out=n) for i, n in enumerate(lengths)]))
    item_charge = policy.decide(snap([view("a")], [pending("new")])).admissions[0].reserved_tokens
    assert item_charge == 100 + 880  # the mean length (0.8·100 + 0.2·4,000)
    young = resident("young", generated=50, reserved=item_charge)
    old = resident("old", generated=150, reserved=item_charge)
    d = policy.decide(snap([view("a", young, old, telemetry=hb(1.0))]))
    assert "young" not in d.recharge  # E[len | len > 50] is still the mean
    assert d.recharge["old"] == 100 + 1000  # past 100 everyone went to 4,000: the cap binds
    policy2 = make_policy("misa_t", tail_stat="quantile", length_quantile=0.5)
    policy2.decide(snap([view("a")], [pending("warm", max_tokens=8000)]))
    policy2.decide(snap([view("a")], done=[completion(f"c{i}", out=n) for i, n in enumerate(lengths)]))
    young = resident("young", generated=50, reserved=9999, max_tokens=8000)
    old = resident("old", generated=150, reserved=9999, max_tokens=8000)
    d = policy2.decide(snap([view("a", young, old, telemetry=hb(1.0))]))
    assert d.recharge["young"] == 100 + 100  # median of the lengths above 50
    assert d.recharge["old"] == 100 + 4000  # everyone past 100 went to 4,000


def test_a_recalled_history_charges_the_first_session_what_it_learned_not_the_cap() -> None:
    cold = make_policy("misa_t")
    first = cold.decide(snap([view("a")], [pending("new")])).admissions[0].reserved_tokens
    assert first == 100 + 1000  # prompt + max_tokens: nothing learned yet
    warm = make_policy("misa_t")
    # Another workload's completions wait for its model; this one's come before its first session.
    warm.recall([completion(f"c{i}", out=300) for i in range(20)]
                + [completion("other", workload="rlvr", out=7000)])
    charge = warm.decide(snap([view("a")], [pending("new")])).admissions[0].reserved_tokens
    assert charge == 100 + 300
    assert list(warm.predictions.model("rlvr", 8000, 1).turn_output.recent) == [7000.0]


def _parked(history: int) -> ResidentSession:
    return resident("ag", workload="agentic", reserved=history, prompt=3000, context=history,
                    generated=history - 3000, turn=3, max_tokens=4096, max_turns=50, parked=True)


def _agentic_policy(tool_wait_per_gap: float, **config: Any) -> MisaT:
    policy = make_policy("misa_t", **config)
    policy.decide(snap([view("a")], [pending("w", workload="agentic", max_tokens=4096, max_turns=50)],
                       target={"agentic": 1.0}))
    done = [completion(f"c{i}", workload="agentic", out=300, turns=11,
                       tool_wait=10 * tool_wait_per_gap) for i in range(40)]
    policy.decide(snap([view("a")], done=done, target={"agentic": 1.0}))
    return policy


def test_parked_agentic_session_stays_charged_while_holding_is_cheaper() -> None:
    policy = _agentic_policy(tool_wait_per_gap=0.5)  # short tools: hold
    d = policy.decide(snap([view("a", _parked(20_000), telemetry=hb(1.0, usage=0.6))],
                           target={"agentic": 1.0}))
    assert d.recharge.get("ag", 20_000) >= 20_000


def test_parked_agentic_session_is_released_when_re_prefill_is_cheaper() -> None:
    policy = _agentic_policy(tool_wait_per_gap=600.0, release_parked=True)  # ten-minute tools
    d = policy.decide(snap([view("a", _parked(20_000), telemetry=hb(1.0, usage=0.6))],
                           target={"agentic": 1.0}))
    assert d.recharge["ag"] == 0


def test_parked_session_stays_charged_by_default_because_it_returns_to_the_same_engine() -> None:
    policy = _agentic_policy(tool_wait_per_gap=600.0)
    d = policy.decide(snap([view("a", _parked(20_000), telemetry=hb(1.0, usage=0.6))],
                           target={"agentic": 1.0}))
    assert d.recharge.get("ag", 20_000) >= 20_000


def test_multi_turn_charge_covers_the_expected_peak_context_once_learned() -> None:
    policy = _agentic_policy(tool_wait_per_gap=1.0)  # 40 completions of 3,400 tokens seen
    # Peak contexts reported by heartbeats reach the completions' own floor (100 + 11·300).
    item = pending("n", workload="agentic", prompt=100, max_tokens=4096, max_turns=50)
    charge = policy.decide(snap([view("a")], [item], target={"agentic": 1.0})).admissions[0].reserved_tokens
    assert charge == 100 + 11 * 300  # E[peak], not prompt + one turn
    running = resident("ag", workload="agentic", reserved=charge, prompt=100, context=500,
                       generated=400, turn=2, max_tokens=4096, max_turns=50)
    d = policy.decide(snap([view("a", running, telemetry=hb(1.0))], target={"agentic": 1.0}))
    assert "ag" not in d.recharge  # still expected to peak at 3,400


def test_expected_end_is_the_conditional_mean_with_the_cap_until_the_tail_is_known() -> None:
    w = TailWindow(size=100, min_samples=4, prior=1000.0)
    assert w.expected_end(0) == 1000.0
    for v in (10, 20, 30, 40, 400, 500, 600, 700):
        w.add(float(v))
    assert w.expected_end(0) == pytest.approx(2300 / 8)
    assert w.expected_end(100) == pytest.approx(550)
    assert w.expected_end(550) == 1000.0  # 2 samples above: unknown tail, the cap


def test_expected_end_follows_every_new_sample_and_the_window_sliding() -> None:
    """It is asked the same few thresholds many times per decide() (every admission asks for
    a turn from 0), so sums are kept between calls: each answer must still be the conditional
    mean of the window as it is now."""
    import random
    rng = random.Random(7)
    w = TailWindow(size=40, min_samples=4, prior=5000.0)
    for _ in range(300):
        w.add(float(rng.randrange(1, 3000)))
        for x in (0.0, 0.0, 100.0, float(rng.randrange(0, 3000))):
            above = [v for v in w.recent if v > x]
            want = sum(above) / len(above) if w.warm and len(above) >= 4 else max(5000.0, x)
            assert w.expected_end(x) == pytest.approx(want)


def test_hold_breaks_even_where_wait_times_history_meets_prefill_price() -> None:
    policy = _agentic_policy(tool_wait_per_gap=5.0)
    v = view("a", telemetry=hb(1.0, usage=0.5))
    # Re-prefilling H tokens costs (11 µs·H + 1.8 ns·H²/2) of engine time × the resident KV,
    # max(50,000, H); holding costs H × 5 s. Past 50k both scale with H: break-even where
    # 5 = 11e-6·H + 0.9e-9·H², H ≈ 69k. Short histories are cheap to redo, long ones to hold.
    assert not policy.residency.hold_is_cheaper("agentic", 1_000, 0.0, v)
    assert not policy.residency.hold_is_cheaper("agentic", 60_000, 0.0, v)
    assert policy.residency.hold_is_cheaper("agentic", 80_000, 0.0, v)


def test_residency_ablation_charges_the_cap_once_and_never_recharges() -> None:
    policy = make_policy("misa_t-residency")
    d = policy.decide(snap([view("a")], [pending("s")]))
    assert d.admissions[0].reserved_tokens == 1100
    d = policy.decide(snap([view("a", resident("s", reserved=1100, generated=900), telemetry=hb(1.0))]))
    assert d.recharge == {}


# -- workload-aware allocation ---------------------------------------------------------------

def test_shares_follow_pi_times_kv_seconds_with_a_bounded_deficit_boost() -> None:
    s = shares({"a": 0.5, "b": 0.5}, {"a": 3.0, "b": 1.0}, {}, 1.0)
    assert s == pytest.approx({"a": 0.75, "b": 0.25})
    s = shares({"a": 0.5, "b": 0.5}, {"a": 1.0, "b": 1.0}, {"a": 30, "b": 70}, 1.0)
    assert s["a"] > 0.5  # a was consumed below target: it gets more
    s = shares({"a": 0.5, "b": 0.5}, {"a": 1.0, "b": 1.0}, {"a": 0, "b": 100}, 10.0)
    assert s["a"] == pytest.approx(2 / 2.5)  # clamped to ×2 against ×0.5


def may_admit(workload, used, quota, waiting) -> bool:
    """The lending rule one workload at a time: the reference `admissible` must agree with."""
    if used.get(workload, 0.0) < quota.get(workload, 0.0):
        return True
    return not any(v != workload and used.get(v, 0.0) < quota.get(v, 0.0) for v in waiting)


def test_may_admit_lends_idle_share_and_stops_lending_when_the_owner_waits() -> None:
    quota = {"a": 50.0, "b": 50.0}
    assert may_admit("a", {"a": 80.0}, quota, waiting={"a"})  # b idle: a borrows
    assert not may_admit("a", {"a": 80.0, "b": 10.0}, quota, waiting={"a", "b"})
    assert may_admit("b", {"a": 80.0, "b": 10.0}, quota, waiting={"a", "b"})
    assert may_admit("a", {"a": 80.0, "b": 60.0}, quota, waiting={"a", "b"})  # b is served


@given(
    st.dictionaries(st.sampled_from("abcd"), st.floats(0, 100), max_size=4),
    st.dictionaries(st.sampled_from("abcd"), st.floats(0, 100), max_size=4),
    st.sets(st.sampled_from("abcd"), min_size=1),
)
def test_admissible_is_may_admit_for_every_waiting_workload(used, quota, waiting) -> None:
    expected = {w for w in waiting if may_admit(w, used, quota, waiting)}
    assert set(admissible(waiting, used, quota)) == expected


def _two_workload_snap(residents, items, *, capacity=10_000):
    return snap([view("a", *residents, capacity=capacity)], items, target={"x": 0.5, "y": 0.5})


def test_borrowed_share_is_reclaimed_only_as_borrowers_finish() -> None:
    policy = make_policy("misa_t-residency", adaptive_admission=False)  # charge 1,100 each
    xs = [pending(f"x{i}", workload="x", at=float(i)) for i in range(20)]
    d = policy.decide(_two_workload_snap([], xs))
    assert len(d.admissions) == 9  # y idle: x borrows the whole backend (9 × 1,100 ≤ 10,000)
    borrowed = [resident(a.session_id, workload="x", reserved=a.reserved_tokens) for a in d.admissions]
    ys = [pending(f"y{i}", workload="y", max_tokens=1000, at=float(i)) for i in range(20)]
    # y now waits, below its quota: x may not admit more, and nothing of x's is taken back.
    d = policy.decide(_two_workload_snap(borrowed, xs[9:] + ys))
    assert d.admissions == [] and d.recharge == {}
    # Three borrowers finish: the freed room goes to y, not to x.
    d = policy.decide(_two_workload_snap(borrowed[3:], xs[9:] + ys))
    assert [a.session_id for a in d.admissions] == ["y0", "y1", "y2"]


def test_a_workload_that_fits_nowhere_does_not_block_the_others() -> None:
    policy = make_policy("misa_t-residency", adaptive_admission=False)  # static charges
    held = [resident(f"x{i}", workload="x", reserved=1_100) for i in range(5)]  # 5,500 > x's 5,000
    ys = [pending("y0", workload="y", max_tokens=12_000)]  # 12,100 fits on no backend
    xs = [pending(f"x{i}", workload="x", at=float(i)) for i in range(5, 10)]
    d = policy.decide(_two_workload_snap(held, ys + xs))
    # y is below its share but cannot place its oldest anywhere now; its room is lent to x
    # (work conservation) instead of idling: 5,500 + 4 × 1,100 ≤ 10,000.
    assert [a.session_id for a in d.admissions] == ["x5", "x6", "x7", "x8"]


@pytest.mark.parametrize("hold", [True, False])
def test_a_blocked_under_served_workload_keeps_the_roomiest_backend(hold) -> None:
    """y is below its share and its oldest (6,000) fits nowhere now: the backend closest to
    fitting it (b, 5,000 free) is kept for y, so x borrows only on a. Without the hold x
    fills b too, and y would wait until some backend drains with nothing else placed there."""
    policy = make_policy("misa_t-residency", adaptive_admission=False, hold_for_blocked=hold)
    on_a = [resident(f"xa{i}", workload="x", reserved=1_100) for i in range(5)]  # 4,500 free
    on_b = [resident(f"xb{i}", workload="x", reserved=1_000) for i in range(5)]  # 5,000 free
    ys = [pending("y0", workload="y", max_tokens=5_900)]
    xs = [pending(f"x{i}", workload="x", at=float(i)) for i in range(10)]
    backends = [view("a", *on_a, capacity=10_000), view("b", *on_b, capacity=10_000)]
    d = policy.decide(snap(backends, ys + xs, target={"x": 0.5, "y": 0.5}))
    placed = sorted(a.backend_id for a in d.admissions)
    assert all(a.session_id.startswith("x") for a in d.admissions)
    assert placed == (["a"] * 4 if hold else ["a"] * 4 + ["b"] * 4)


def test_a_blocked_head_is_not_counted_again_in_the_prompt_mean_on_every_call() -> None:
    policy = make_policy("misa_t-residency", adaptive_admission=False)
    placed = [pending(f"s{i}", prompt=100, at=float(i)) for i in range(10)]
    policy.decide(snap([view("a", capacity=20_000)], placed))
    assert policy.predictions.models["rlhf"].prompt_mean == 100.0
    blocked = [pending("big", prompt=5_000, max_tokens=30_000, at=20.0)]  # fits nowhere
    for t in range(60):
        assert policy.decide(snap([view("a", capacity=20_000)], blocked, now=float(t))).admissions == []
    assert policy.predictions.models["rlhf"].prompt_mean == 100.0


def test_allocation_ablation_admits_oldest_first_across_workloads() -> None:
    policy = make_policy("misa_t-allocation", residency_accounting=False, adaptive_admission=False)
    items = [pending("y0", workload="y", at=0.0), pending("x0", workload="x", at=1.0),
             pending("y1", workload="y", at=2.0)]
    d = policy.decide(_two_workload_snap([], items, capacity=2300))
    assert [a.session_id for a in d.admissions] == ["y0", "x0"]


def test_pacer_holds_back_only_a_workload_ahead_in_the_completion_stream() -> None:
    # x: 10 in flight, 100 s each -> 0.1 finishes/s; y: 10 s each. π = 0.5 / 0.5.
    pacer = CompletionPacer.start({"x": 0.5, "y": 0.5}, 0.0, {"x": 100.0, "y": 10.0}, {"x": 10}, "all")
    assert not pacer.ahead("y") and not pacer.ahead("x")  # x runs alone: nobody is ahead
    pacer.admitted("y", 1)  # y: 0.1/s of 0.2/s total, exactly its share
    assert not pacer.ahead("y") and not pacer.ahead("x")
    pacer.admitted("y", 1)  # y: 0.2/s of 0.3/s
    assert pacer.ahead("y") and not pacer.ahead("x")
    assert CompletionPacer.start({"x": 0.5, "y": 0.5}, 1.0, {"x": 100.0, "y": 10.0},
                                 {"x": 10, "y": 2}, "all").ahead("y") is False  # 2/3 ≤ (1 + 1)·0.5


def test_fast_scope_paces_only_workloads_quicker_than_the_mixtures_mean_session() -> None:
    # Mean session: 0.5·100 + 0.5·10 = 55 s. x (100 s) is slow, y (10 s) is fast.
    def start(scope: str, flight: dict[str, int]) -> CompletionPacer:
        return CompletionPacer.start({"x": 0.5, "y": 0.5}, 0.0, {"x": 100.0, "y": 10.0}, flight, scope)

    assert start("all", {"x": 100, "y": 1}).ahead("x")  # x: 1.0/s of 1.1/s
    assert not start("fast", {"x": 100, "y": 1}).ahead("x")  # slow: never held back
    assert start("fast", {"x": 1, "y": 10}).ahead("y")  # y: 1.0/s of 1.01/s
    with pytest.raises(ValueError, match="pace_scope"):
        start("some", {})


def test_pacer_never_holds_back_the_only_running_workload_or_stalls_an_empty_fleet() -> None:
    durations = {"x": 100.0, "y": 10.0, "z": 5.0}
    empty = CompletionPacer.start({"x": 0.5, "y": 0.5}, 0.0, durations, {}, "all")
    assert not any(empty.ahead(w) for w in durations)
    alone = CompletionPacer.start({"x": 0.5, "y": 0.5}, 0.0, durations, {"y": 50}, "all")
    assert not alone.ahead("y") and not alone.ahead("z")
    alone.admitted("z", 1)  # z has no share of the mixture: one placement in flight at most
    assert alone.ahead("z")


def test_paced_variant_admits_a_fast_workload_only_up_to_its_share_of_completions() -> None:
    target = {"x": 0.5, "y": 0.5}
    runs = {}
    for name in ("misa_t", "misa_t-paced"):
        policy = make_policy(name, adaptive_admission=False)
        first = [pending("x0", workload="x"), pending("y0", workload="y")]
        assert len(policy.decide(snap([view("a")], first, target=target)).admissions) == 2
        done = [completion(f"x{i}", workload="x", duration=100.0) for i in range(1, 17)]
        done += [completion(f"y{i}", workload="y", duration=10.0) for i in range(1, 17)]
        xs = [resident(f"x{i}", workload="x", reserved=600) for i in range(20, 30)]
        ys = [pending(f"y{i}", workload="y", at=float(i)) for i in range(20, 40)]
        d = policy.decide(snap([view("a", *xs)], ys, target=target, done=done, now=1.0))
        runs[name] = [a.session_id for a in d.admissions]
    # 10 x sessions finish 0.1/s; each y admitted adds 0.1/s: y may run two (it admits while
    # at or below its half of the total before the admission), then it is ahead.
    assert runs["misa_t-paced"] == ["y20", "y21"]
    assert len(runs["misa_t"]) == 20  # unpaced: the room decides, and there is room for all
    paced = make_policy("misa_t-paced")
    assert (paced.config.pace_tolerance, paced.config.pace_scope) == (0.0, "fast")
    assert MisaT().config.pace_tolerance == float("inf")


# -- placement -------------------------------------------------------------------------------

def test_grpo_group_stays_together_until_it_would_overload_one_decode_batch() -> None:
    def place(size: int) -> dict[str, int]:
        policy = make_policy("misa_t")
        group = [pending(f"g-{i}", workload="rlvr", group="g", size=size, prompt=160)
                 for i in range(size)]
        d = policy.decide(snap([view("a"), view("b"), view("c")], group, target={"rlvr": 1.0}))
        assert len(d.admissions) == size
        out: dict[str, int] = {}
        for a in d.admissions:
            out[a.backend_id] = out.get(a.backend_id, 0) + 1
        return out

    slack = MisaTConfig().balance_slack_sessions
    assert len(place(slack + 1)) == 1  # one prefill of the shared prompt, a batch still even
    spread = place(24)  # 24 on one engine while two sit idle: split, each part together
    assert len(spread) == 3 and max(spread.values()) - min(spread.values()) <= slack + 1


def test_group_that_fits_nowhere_whole_is_split_rather_than_left_waiting() -> None:
    policy = make_policy("misa_t-residency", adaptive_admission=False)
    group = [pending(f"g-{i}", workload="rlvr", group="g", size=4, prompt=160) for i in range(4)]
    # Each member charges 1,160; each backend has room for two.
    d = policy.decide(snap([view("a", capacity=2400), view("b", capacity=2400)], group,
                           target={"rlvr": 1.0}))
    assert sorted(a.backend_id for a in d.admissions) == ["a", "a", "b", "b"]


def test_each_member_of_a_group_is_charged_for_its_own_prompt() -> None:
    policy = make_policy("misa_t-residency", adaptive_admission=False)
    group = [pending(f"g-{i}", workload="rlvr", group="g", size=3, prompt=p)
             for i, p in enumerate((160, 160, 900))]
    d = policy.decide(snap([view("a")], group, target={"rlvr": 1.0}))
    assert [a.reserved_tokens for a in d.admissions] == [1160, 1160, 1900]


def test_new_session_follows_its_cached_prefix_and_followups_stay_home() -> None:
    policy = make_policy("misa_t")
    system = tuple(range(5000, 8000))
    first = pending("s1", workload="agentic", prompt=3200, prefix=system + tuple(range(200)),
                    max_tokens=4096, max_turns=50)
    d = policy.decide(snap([view("a"), view("b")], [first], target={"agentic": 1.0}))
    home = d.admissions[0].backend_id
    other = "b" if home == "a" else "a"
    second = pending("s2", workload="agentic", prompt=3200, prefix=system + tuple(range(300, 500)),
                     max_tokens=4096, max_turns=50)
    r = resident("s1", workload="agentic", reserved=d.admissions[0].reserved_tokens)
    backends = [view(home, r) if home == "a" else view("a"), view(home, r) if home == "b" else view("b")]
    d = policy.decide(snap(backends, [second], target={"agentic": 1.0}))
    assert d.admissions[0].backend_id == home  # 3,000 shared tokens cached there
    follow = pending("s1", workload="agentic", prompt=9000, max_tokens=4096, max_turns=50,
                     turn=4, home=other)
    d = policy.decide(snap([view("a"), view("b")], [follow], target={"agentic": 1.0}))
    assert [(a.session_id, a.backend_id) for a in d.admissions] == [("s1", other)]


def _place_group(prompt: int, *, held: int = 0, learned: bool = True) -> list[str]:
    """Where MISA-T puts an rlvr GRPO group of 4 (outputs of ~4,000 tokens, learned from the
    namespace's history, one shared prompt of `prompt` tokens) on four backends, each already
    charged `held`."""
    policy = make_policy("misa_t")
    if learned:
        policy.recall([completion(f"c{i}", workload="rlvr", out=4000) for i in range(20)])
    shared = tuple(range(prompt))
    group = [pending(f"g-{i}", workload="rlvr", group="g", size=4, prompt=prompt, prefix=shared,
                     max_tokens=8192) for i in range(4)]
    backends = [view(b, *([resident(f"{b}-r", workload="rlvr", reserved=held, max_tokens=8192)]
                          if held else ())) for b in "abcd"]
    d = policy.decide(snap(backends, group, target={"rlvr": 1.0}))
    assert len(d.admissions) == 4
    return [a.backend_id for a in d.admissions]


def test_a_group_follows_its_prefix_only_where_that_saves_more_than_it_decodes() -> None:
    # A 150-token prompt against ~4,000 tokens of output each: the members' decodes would pile
    # on one engine for a prefill a fraction of one of them, so they spread while KV is spare.
    assert _place_group(150) == ["a", "b", "c", "d"]
    # A 6,000-token shared prompt is worth more than the output: they follow it, within the
    # balance slack of one running session.
    assert _place_group(6000) == ["a", "a", "b", "b"]
    # Where the four would not all fit in the caches' free KV (3,000 tokens free on each, a
    # member charged ~4,150), the shared prompt's blocks are what is scarce: it counts again.
    assert _place_group(150, held=CAP - 3000) == ["a", "a", "b", "b"]
    assert _place_group(150, held=CAP - 5000) == ["a", "b", "c", "d"]  # (20,000 free: they fit)
    # Before any length is learned the outputs are known only by their cap: the prefix counts.
    assert _place_group(150, learned=False) == ["a", "a", "b", "b"]


def test_prefix_index_matches_by_landmark_and_forgets_after_a_cache_of_churn() -> None:
    index = PrefixIndex()
    index.sync_backend("a", 1000)
    key = prefix_key(tuple(range(400)))  # 25 blocks: landmarks 1, 2, 4, 8, 16, 25
    assert key.tokens == (16, 32, 64, 128, 256, 400)
    index.insert(key, "a", 400)
    assert index.match(key, "a") == 400
    assert index.match(prefix_key(tuple(range(300)) + (9,) * 100), "a") == 256
    index.insert(prefix_key((7,) * 64), "a", 1001)
    assert index.match(key, "a") == 0


def test_ratio_window_is_a_ratio_of_sums_over_the_latest_pairs() -> None:
    w = RatioWindow(size=3, min_samples=2)
    w.add(1.0, 2.0)
    assert w.ratio() is None
    w.add(3.0, 2.0)
    assert w.ratio() == pytest.approx(1.0)
    w.add(2.0, 4.0)
    w.add(10.0, 10.0)  # (1, 2) slides out
    assert w.ratio() == pytest.approx(15.0 / 16.0)


def test_tail_window_is_a_sliding_sorted_multiset() -> None:
    w = TailWindow(size=4, min_samples=2, prior=99.0)
    assert w.quantile(0.5) == 99.0
    for v in (5, 1, 3, 3, 8):
        w.add(v)
    assert w.sorted == [1, 3, 3, 8]
    assert w.tail_quantile(3, 0.5) == 99.0  # one sample above 3: the prior answers
    assert w.tail_quantile(0, 0.9) == 8


def test_tail_window_mean_follows_the_window_between_questions() -> None:
    """mean() is kept between adds (a decide() asks it for every workload); each add renews it."""
    w = TailWindow(size=3, min_samples=2, prior=99.0)
    w.add(4)
    assert w.mean() == 99.0  # cold: the prior
    w.add(8)
    assert w.mean() == 6.0
    w.add(0)
    assert w.mean() == 4.0
    w.add(12)  # 4 slides out
    assert w.mean() == pytest.approx(20 / 3)


# -- no hidden fields ------------------------------------------------------------------------

def test_no_policy_module_can_reach_the_simulators_truth() -> None:
    package = Path(base.__file__).parent
    for path in package.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert not name.startswith("sim"), f"{path.name} imports {name}"
    truth_fields = {"output_tokens", "truncated", "tool_latency_s", "observation_tokens",
                    "final_latency_s", "token_seed", "truth", "output_len", "stop_len"}
    for cls in (PendingItem, ResidentSession, BackendView, Telemetry, Snapshot):
        leaked = truth_fields & {f.name for f in dataclasses.fields(cls)}
        assert not leaked, f"{cls.__name__} carries {leaked}"


def test_true_lengths_differs_from_misa_t_only_by_the_lengths_it_is_given() -> None:
    true_lengths = make_policy("misa_t-true-lengths", true_output_lengths=lambda sid: (321,))
    d = true_lengths.decide(snap([view("a")], [pending("s")]))
    assert d.admissions[0].reserved_tokens == 100 + 321
    d = make_policy("misa_t").decide(snap([view("a")], [pending("s")]))
    assert d.admissions[0].reserved_tokens == 100 + 1000  # the cap, before any completion


def test_ablations_are_misa_t_with_one_switch_off() -> None:
    for name, switch in (("misa_t-admission", "adaptive_admission"),
                         ("misa_t-allocation", "workload_allocation"),
                         ("misa_t-residency", "residency_accounting")):
        policy = make_policy(name)
        assert isinstance(policy, MisaT) and policy.name == name
        assert getattr(policy.config, switch) is False
        others = {f.name for f in dataclasses.fields(policy.config)} - {switch}
        default = MisaT().config
        assert all(getattr(policy.config, o) == getattr(default, o) for o in others)


def grpo_pairs(rng, step: int, now: float) -> list[PendingItem]:
    """Up to three GRPO pairs of either workload, on a few shared 300-token prompts."""
    items = []
    for i in range(rng.randint(0, 3)):
        w, p = rng.choice(("rlhf", "rlvr")), rng.randrange(6)
        prompt = tuple(range(p * 1000, p * 1000 + 300))
        items += [pending(f"p{step}-{i}-{m}", workload=w, group=f"g{step}-{i}", size=2,
                          prompt=300, prefix=prompt, at=now) for m in range(2)]
    return items


def test_sums_kept_for_an_unchanged_backend_give_the_decisions_of_summing_again() -> None:
    """The broker hands back the very same sessions tuple for a backend where nothing changed;
    MisaT then reuses its accounting there (sums, α, prefix horizon) unless its heartbeat or
    cache size moved. Decisions must be those of a policy given copies (which accounts for
    every backend every time), and no backend may be charged past α·C by what it holds and
    what it gets."""
    import random
    rng = random.Random(3)
    kept, summed = MisaT(open_single_turn=False), MisaT(open_single_turn=False)  # α binds
    residents: dict[str, list[ResidentSession]] = {b: [] for b in "abcd"}
    tuples: dict[str, tuple[ResidentSession, ...]] = {}
    beats: dict[str, Telemetry] = {}
    caps = dict.fromkeys("abcd", 20_000)
    n = 0
    for step in range(200):
        now = float(step)
        for b in rng.sample("abcd", 2):  # two backends change each step
            if residents[b] and rng.random() < 0.4:
                residents[b].pop(rng.randrange(len(residents[b])))
            else:
                residents[b].append(resident(f"r{n}", reserved=rng.randint(500, 5000),
                                             workload=rng.choice(("rlhf", "rlvr"))))
                n += 1
            tuples[b] = tuple(residents[b])
        if step % 3 == 0:
            b = rng.choice("abcd")
            beats[b] = hb(now, usage=rng.uniform(0.2, 0.9))
        if step % 17 == 5:  # a backend's engine restarts with another cache size
            caps[rng.choice("abcd")] = rng.choice((16_000, 20_000, 24_000))
        items = grpo_pairs(rng, step, now)
        same = [view(b, telemetry=beats.get(b), capacity=caps[b]) for b in "abcd"]
        same = [dataclasses.replace(v, sessions=tuples.get(b, ())) for b, v in zip("abcd", same)]
        copies = [dataclasses.replace(v, sessions=tuple(list(v.sessions))) for v in same]
        mix = {"rlhf": 0.5, "rlvr": 0.5}
        a = kept.decide(snap(same, items, now=now, target=mix))
        b_ = summed.decide(snap(copies, items, now=now, target=mix))
        assert a == b_, f"step {step}"
        for b in "abcd":
            got = sum(adm.reserved_tokens for adm in a.admissions if adm.backend_id == b)
            if got:
                held = sum(a.recharge.get(r.session_id, r.reserved_tokens) for r in tuples.get(b, ()))
                assert held + got <= kept.alpha_loop.alpha[b] * caps[b] + 1e-6, f"step {step}, backend {b}"
        for adm in a.admissions:  # the broker would add them: a new tuple there
            tuples[adm.backend_id] = tuples.get(adm.backend_id, ()) + (
                resident(adm.session_id, reserved=int(adm.reserved_tokens)),)
            residents[adm.backend_id] = list(tuples[adm.backend_id])


@pytest.mark.parametrize("n", [4, 140])  # 140: the placement's array evaluation
def test_accounting_kept_across_calls_decides_as_accounting_every_backend_again(n) -> None:
    """MisaT keeps each backend's sums, its working state and the placement across calls and
    redoes only what moved. Fed what the broker's ViewCache hands back (the very same view
    while a backend is unchanged) through re-charges, refused admissions, heartbeats, new cache
    sizes, health changes, backends leaving and coming back, and admission closing (open while
    the mixture is single-turn, closed once a multi-turn workload joins it), it must decide as
    a policy fed fresh copies of everything (which accounts every backend again on every call,
    over a new placement), and its per-workload total must be what the ledger charges."""
    import random
    rng = random.Random(n)
    kept, again = MisaT(), MisaT()
    ids = [f"b{i}" for i in range(n)]
    residents: dict[str, tuple[ResidentSession, ...]] = dict.fromkeys(ids, ())
    beats: dict[str, Telemetry] = {}
    caps, healthy, present = dict.fromkeys(ids, 20_000), dict.fromkeys(ids, True), set(ids)
    views: dict[str, BackendView] = {}
    mix = {"rlhf": 0.5, "rlvr": 0.5}
    k = 0
    for step in range(150):
        now = float(step)
        changed = set(rng.sample(ids, 2))
        for b in changed:
            if residents[b] and rng.random() < 0.4:
                gone = rng.randrange(len(residents[b]))
                residents[b] = residents[b][:gone] + residents[b][gone + 1:]
            else:
                residents[b] += (resident(f"r{k}", reserved=rng.randint(500, 5000),
                                          workload=rng.choice(("rlhf", "rlvr"))),)
                k += 1
        if step % 3 == 0:
            b = rng.choice(ids)
            beats[b] = hb(now, usage=rng.uniform(0.2, 0.9))
            changed.add(b)
        if step % 17 == 5:  # an engine restarts with another cache size
            b = rng.choice(ids)
            caps[b] = rng.choice((16_000, 20_000, 24_000))
            changed.add(b)
        if step % 11 == 3:
            b = rng.choice(ids)
            healthy[b] = not healthy[b]
            changed.add(b)
        if step % 13 == 7:  # a backend leaves (its sessions requeued) or comes back empty
            swap = [rng.choice(ids)]
            if step % 2 and 0 < len(present) < n:  # ... both at once: as many as before
                swap = [rng.choice(sorted(present)), rng.choice(sorted(set(ids) - present))]
            for b in swap:
                present ^= {b}
                residents[b] = ()
                changed.add(b)
        for b in ids:
            if b in changed or b not in views:
                views[b] = BackendView(backend_id=b, capacity_tokens=caps[b],
                                       max_model_len=caps[b], healthy=healthy[b], alpha=1.0,
                                       telemetry=beats.get(b), sessions=residents[b])
        shown = [views[b] for b in ids if b in present]
        copies = [dataclasses.replace(v, sessions=tuple(list(v.sessions))) for v in shown]
        items = grpo_pairs(rng, step, now)
        if step >= 75:  # a multi-turn workload joins the mixture: admission closes
            mix = {"rlhf": 0.4, "rlvr": 0.4, "agentic": 0.2}
            if step % 5 == 0:
                items.append(pending(f"a{step}", workload="agentic", max_turns=3, at=now))
        # A follow-up turn (router mode) goes home, whatever the limits; here to the emptiest
        # backend, where a new group would go but for it.
        home = min((v for v in shown if v.healthy), key=lambda v: v.reserved_tokens, default=None)
        if home is not None and rng.random() < 0.3:
            items.append(pending(f"f{step}", workload=rng.choice(("rlhf", "rlvr")), turn=1,
                                 home=home.backend_id, max_turns=3, prompt=4000, at=now))
        a = kept.decide(snap(shown, items, now=now, target=mix))
        again.book._placement = None  # (a placement built afresh too)
        assert a == again.decide(snap(copies, items, now=now, target=mix)), f"step {step}"
        charged: dict[str, float] = {}
        for v in shown:
            for r in v.sessions:
                charged[r.workload] = charged.get(r.workload, 0) + a.recharge.get(
                    r.session_id, r.reserved_tokens)
        assert {w: u for w, u in kept.book.used.items() if u} == charged, f"step {step}"
        for adm in a.admissions:  # the broker adds them to the ledger: a new view there ...
            if rng.random() < 0.2:
                continue  # ... unless the ledger refused it (the same view comes back)
            residents[adm.backend_id] += (resident(adm.session_id, reserved=adm.reserved_tokens),)
            views.pop(adm.backend_id, None)
        if a.recharge and rng.random() < 0.5:  # (else the broker has not applied them yet)
            for b in ids:
                if any(r.session_id in a.recharge for r in residents[b]):
                    residents[b] = tuple(dataclasses.replace(
                        r, reserved_tokens=a.recharge.get(r.session_id, r.reserved_tokens))
                        for r in residents[b])
                    views.pop(b, None)


@pytest.mark.parametrize("n", [4, 140])
def test_a_follow_up_turn_placed_at_home_counts_in_the_same_calls_choices(n) -> None:
    """A follow-up turn goes home first; a new session of the same call must see that backend's
    reservation grown (at 140 backends, in the placement's arrays too): of equal empty backends
    it takes the next one, not the home."""
    policy = MisaT()
    views = [view(f"b{i}") for i in range(n)]
    items = [pending("turn", turn=1, home="b0", max_turns=3, prompt=4000),
             pending("new", prompt=100, prefix=tuple(range(50_000, 50_100)), at=1.0)]
    d = policy.decide(snap(views, items))
    assert [(a.session_id, a.backend_id) for a in d.admissions] == [("turn", "b0"), ("new", "b1")]


def test_a_backend_whose_cache_size_changes_is_accounted_again_with_the_same_sessions() -> None:
    """An engine restarted with another KV size may come back with the very same sessions
    tuple; the prefix index's horizon and the context limit must follow its new size."""
    policy = MisaT()
    sessions = (resident("r1", reserved=2000),)
    for step, (capacity, max_len) in enumerate(((20_000, 9_000), (20_000, 9_000),
                                                (8_000, 9_000), (8_000, 7_000))):
        v = dataclasses.replace(view("a", capacity=capacity), sessions=sessions,
                                max_model_len=max_len)
        policy.decide(snap([v], [pending(f"p{step}")]))
        assert policy.prefix._caches["a"].horizon == capacity
        assert policy.predictions.max_len == max_len


def test_one_insert_of_a_groups_tokens_leaves_the_index_as_one_per_member() -> None:
    """What MisaT relies on to record a group once per backend it went to (`_admit_next`):
    inserting a key n times with t_1..t_n tokens, interleaved with its other backends' inserts,
    leaves every key's matches and every backend's churn as inserting it once with Σ t_i."""
    import random
    rng = random.Random(11)
    keys = [prefix_key(tuple(rng.randrange(1000) for _ in range(rng.randrange(16, 600))))
            for _ in range(30)]
    for _ in range(200):
        per_member, batched = PrefixIndex(), PrefixIndex()
        for index in (per_member, batched):
            for b in "abc":
                index.sync_backend(b, 5_000)
        for _ in range(rng.randrange(1, 6)):  # earlier groups, placed the same on both
            k, b, t = rng.choice(keys), rng.choice("abc"), rng.choice((50.0, 800.0, 3_000.0))
            per_member.insert(k, b, t)
            batched.insert(k, b, t)
        key = rng.choice(keys)
        members = [(rng.choice("abc"), rng.choice((0.0, 200.0, 1_500.0))) for _ in range(8)]
        fed: dict[str, float] = {}
        for b, t in members:
            per_member.insert(key, b, t)
            fed[b] = fed.get(b, 0.0) + t
        for b, t in fed.items():
            batched.insert(key, b, t)
        assert all(per_member.matches(k) == batched.matches(k) for k in keys)
        assert {b: c.churn for b, c in per_member._caches.items()} == \
            {b: c.churn for b, c in batched._caches.items()}


def test_placing_a_key_changes_its_matches_only_on_that_backend_to_the_whole_key() -> None:
    """What MisaT relies on to place a group's members without a new prefix lookup each
    (misa_t_placement.Placement.key_placed): after insert(key, b), matches(key) is what it was,
    except that b caches the whole key — whatever b's churn ages out for other keys."""
    import random
    rng = random.Random(5)
    index = PrefixIndex()
    for b in "abcdef":
        index.sync_backend(b, rng.choice((2_000, 20_000)))
    system = tuple(range(50_000, 51_000))
    keys = [prefix_key(system[:rng.choice((0, 500, 1000))] + tuple(rng.randrange(1000) for _ in range(rng.randrange(1, 600))))
            for _ in range(40)]
    keys = [k for k in keys if k.hashes]
    for _ in range(2_000):
        key = rng.choice(keys)
        b = rng.choice("abcdef")
        before = index.matches(key)
        index.insert(key, b, rng.choice((10.0, 500.0, 5_000.0)))
        assert index.matches(key) == {**before, b: key.tokens[-1]}
