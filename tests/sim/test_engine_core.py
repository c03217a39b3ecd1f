"""EngineCore: finish reasons, aborts, deterministic token ids, invariants under random
operations, and bulk advancing ≡ stepping one step at a time."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.engine.core import EngineCore
from sim.engine.profiles import get_profile
from sim.engine.request import EngineRequest, FinishReason, RequestStatus
from sim.engine.sampling import FIRST_GENERATED_ID

ONE_SEC = dataclasses.replace(get_profile("h100-8b"), kv_tokens=16 * 9, max_num_batched_tokens=32,
                              max_num_seqs=4, t0=1.0, t_seq=0, a=0, b=0, c=0)
# Every constant a power of two: sums of step times are exact in floating point, so the two
# paths can be compared with ==, times included, while every cost term still matters.
DYADIC = dataclasses.replace(get_profile("h100-8b"), kv_tokens=16 * 40, max_num_batched_tokens=64,
                             max_num_seqs=6, t0=2.0 ** -3, t_seq=2.0 ** -9, a=2.0 ** -10,
                             b=2.0 ** -14, c=2.0 ** -18)


# -- finish reasons and lengths ------------------------------------------------------------

@pytest.mark.parametrize("bulk", [False, True])
def test_finish_reasons_and_lengths(bulk):
    core = EngineCore(ONE_SEC, bulk=bulk)
    core.add_request(EngineRequest("eos", [1] * 5, 9, ignore_eos=True, output_len=3))
    core.add_request(EngineRequest("short", [2] * 5, 9, output_len=3))
    core.add_request(EngineRequest("capped", [3] * 5, 4, output_len=30))
    core.add_request(EngineRequest("exact", [4] * 5, 6, output_len=6))
    done = {r.request_id: r for r in core.run_until_idle()}
    got = {k: (r.num_output_tokens, r.finish_reason, len(r.output_token_ids)) for k, r in done.items()}
    assert got == {
        "eos": (9, FinishReason.length, 9),  # ignore_eos: exactly max_tokens, whatever output_len says
        "short": (3, FinishReason.stop, 3),  # the sim's EOS position comes first
        "capped": (4, FinishReason.length, 4),
        "exact": (6, FinishReason.length, 6),  # reaching max_tokens is `length`, as in vLLM
    }
    # All four prefill together at t=0 (20 tokens ≤ 32), 1st token at t=1, then 1 per step.
    assert {k: r.finish_time for k, r in done.items()} == {"eos": 9.0, "short": 3.0, "capped": 4.0,
                                                           "exact": 6.0}
    s = core.stats()
    assert s.generation_tokens_total == 22 and s.prompt_tokens_total == 20 and s.steps_total == 9


def test_eos_model_length_is_seeded_and_within_max_tokens():
    def run(seed):
        core = EngineCore(get_profile("h100-8b"), seed=seed)
        for i in range(20):
            core.add_request(EngineRequest(f"r{i}", [5, 6, 7], 2000))
        return {r.request_id: (r.num_output_tokens, r.finish_reason) for r in core.run_until_idle()}

    a, b, c = run(1), run(1), run(2)
    assert a == b and a != c
    assert all(1 <= n <= 2000 for n, _ in a.values())
    assert {reason for n, reason in a.values() if n < 2000} <= {FinishReason.stop}


def test_token_ids_are_deterministic_per_seed():
    def ids(engine_seed, req_seed=None, rid="x"):
        core = EngineCore(ONE_SEC, seed=engine_seed)
        core.add_request(EngineRequest(rid, [1, 2, 3], 40, output_len=40, seed=req_seed))
        return core.run_until_idle()[0].output_token_ids

    a = ids(0)
    assert len(a) == 40 and a == ids(0)
    assert a != ids(1) and a != ids(0, rid="y")
    # A request's own seed replaces the id-derived one (the engine seed still mixes in).
    assert ids(0, req_seed=7) == ids(0, req_seed=7, rid="other")
    assert all(FIRST_GENERATED_ID <= t < ONE_SEC.vocab_size for t in a)


def test_recompute_after_preemption_emits_the_same_tokens():
    # Same pair as the hand-worked preemption case in test_scheduler: B is preempted at t=33.
    def run(kv_tokens):
        core = EngineCore(ONE_SEC, kv_tokens=kv_tokens, bulk=False)
        core.add_request(EngineRequest("A", list(range(1, 33)), 40, ignore_eos=True))
        core.add_request(EngineRequest("B", list(range(101, 133)), 64, output_len=40))
        return {r.request_id: r for r in core.run_until_idle()}

    tight, roomy = run(16 * 9), run(16 * 20)
    assert tight["B"].num_preemptions == 1 and roomy["B"].num_preemptions == 0
    assert tight["B"].output_token_ids == roomy["B"].output_token_ids


# -- aborts ----------------------------------------------------------------------------------

@pytest.mark.parametrize("bulk", [False, True])
def test_abort_running_and_waiting(bulk):
    core = EngineCore(ONE_SEC, bulk=bulk)
    core.add_request(EngineRequest("a", [1] * 20, 30, output_len=30))
    core.add_request(EngineRequest("b", [2] * 20, 40, output_len=30))
    core.add_request(EngineRequest("late", [3] * 20, 30, output_len=30, arrival_time=50.0))
    core.advance(5.5)  # t=0: a (20) + b (12); t=1: b (8) + a decodes; … step [5, 6) in flight
    assert core.abort_request("a") is not None
    assert core.abort_request("late") is not None  # not arrived yet
    assert core.abort_request("nope") is None
    done = {r.request_id: r for r in core.run_until_idle()}
    a, b, late = done["a"], done["b"], done["late"]
    # The step in flight at 5.5 completes first: a's abort lands at t=6 with 6 outputs.
    assert (a.finish_reason, a.finish_time, a.num_output_tokens) == (FinishReason.abort, 6.0, 6)
    assert late.finish_reason is FinishReason.abort and late.num_output_tokens == 0
    # b's first token at t=2, then one per step: 30th at t=31.
    assert (b.finish_reason, b.finish_time) == (FinishReason.stop, 31.0)
    s = core.stats()
    assert s.requests_finished_total[FinishReason.abort] == 2 and s.kv_usage == 0.0
    assert s.num_running == s.num_waiting == 0
    core.check_invariants()


# -- random operations: invariants after every step ------------------------------------------

@settings(deadline=None, derandomize=True, max_examples=30)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "add", "add", "abort", "advance"]),
                              st.integers(0, 3), st.integers(1, 120), st.integers(1, 60),
                              st.floats(0.0, 8.0)), min_size=1, max_size=40))
def test_random_operations_keep_invariants(ops):
    core = EngineCore(ONE_SEC, bulk=False)
    bases = [[(b * 31 + j) % 997 for j in range(120)] for b in range(4)]
    ids = []
    for i, (op, base, plen, out, dt) in enumerate(ops):
        if op == "add":
            rid = f"r{i}"
            out = min(out, core.max_model_len - plen)  # 128 here: KV holds 8 blocks
            core.add_request(EngineRequest(rid, bases[base][:plen], out, output_len=out,
                                           arrival_time=core.now + dt))
            ids.append(rid)
        elif op == "abort" and ids:
            core.abort_request(ids[plen % len(ids)])
        else:
            end = core.now + dt
            while (t := core.next_event_time()) is not None and t <= end:
                core.advance(t)
                core.check_invariants()
                sch = core.scheduler
                held = sum(len(r.blocks) for r in sch.running)
                assert held + core.kv.pool.num_free >= core.num_gpu_blocks - 1  # shared blocks
                assert all(r.status is not RequestStatus.running for r in sch.waiting)
    done = core.run_until_idle()
    core.check_invariants()
    assert not core.requests and core.stats().kv_usage == 0.0
    assert len({r.request_id for r in done}) == len(done)


# -- bulk ≡ step ------------------------------------------------------------------------------

def _workload(seed: int):
    """Arrivals at dyadic times (some up front, some added by the driver when they happen),
    prompts built on a few shared prefixes, random lengths, and a few aborts."""
    rng = random.Random(seed)
    bases = [[rng.randrange(FIRST_GENERATED_ID, 5000) for _ in range(200)] for _ in range(3)]
    reqs = []
    t = 0.0
    for i in range(36):
        t += rng.choice([0.0, 0.0, 0.125, 0.5, 1.0, 2.25])
        shared = rng.choice([0, 16, 40, 64, 100])
        prompt = bases[rng.randrange(3)][:shared] + [rng.randrange(FIRST_GENERATED_ID, 5000)
                                                     for _ in range(rng.randint(1, 90))]
        out = rng.choice([rng.randint(1, 20), rng.randint(20, 200)])
        ignore = rng.random() < 0.2
        reqs.append(dict(request_id=f"r{i}", prompt_token_ids=prompt, max_tokens=out + rng.randint(0, 30),
                         output_len=out, ignore_eos=ignore, arrival_time=t,
                         upfront=rng.random() < 0.5))
    aborts = sorted((rng.uniform(0, t + 20) // 0.0625 * 0.0625, f"r{rng.randrange(36)}") for _ in range(4))
    return reqs, aborts


def _add_upfront(core, reqs):
    """Adds the up-front requests of `reqs` to `core`; returns the others as (arrival, spec),
    in arrival order."""
    later = []
    for r in reqs:
        spec = {k: v for k, v in r.items() if k != "upfront"}
        if r["upfront"]:
            core.add_request(EngineRequest(**spec))
        else:
            later.append((spec["arrival_time"], spec))
    return sorted(later, key=lambda a: a[0])


def _drive(profile, reqs, aborts, bulk, seed, policy="fcfs"):
    core = EngineCore(profile, seed=seed, bulk=bulk, scheduling_policy=policy)
    events = [(t, 0, spec) for t, spec in _add_upfront(core, reqs)]
    events += [(t, 1, rid) for t, rid in aborts]
    events.sort(key=lambda e: (e[0], e[1]))
    done = []
    for t, kind, payload in events:
        done += core.advance(t)
        if kind == 0:
            core.add_request(EngineRequest(**payload))
        else:
            core.abort_request(payload)
    done += core.run_until_idle()
    core.check_invariants()
    per_req = {r.request_id: (r.finish_time, r.finish_reason, r.first_token_time, r.num_cached_tokens,
                              r.num_preemptions, r.num_output_tokens, tuple(r.output_token_ids))
               for r in done}
    s = core.stats()
    counters = dataclasses.asdict(s)
    return per_req, counters


@pytest.mark.parametrize("seed", range(6))
def test_bulk_advancing_equals_stepping(seed):
    reqs, aborts = _workload(seed)
    step = _drive(DYADIC, reqs, aborts, bulk=False, seed=seed)
    bulk = _drive(DYADIC, reqs, aborts, bulk=True, seed=seed)
    assert len(step[0]) == len(reqs)
    assert bulk[0] == step[0]
    assert bulk[1] == step[1]
    # The workload must exercise what the bulk path shortcuts: preemption, hits, aborts.
    s = step[1]
    assert s["num_preemptions_total"] > 0
    assert s["prefix_hits_total"] > 0
    assert s["requests_finished_total"][FinishReason.abort] > 0


@pytest.mark.parametrize("seed", range(4))
def test_bulk_advancing_equals_stepping_under_priority_scheduling(seed):
    reqs, aborts = _workload(seed)
    rng = random.Random(seed)
    for r in reqs:
        r["priority"] = rng.randrange(4)
    step = _drive(DYADIC, reqs, aborts, bulk=False, seed=seed, policy="priority")
    bulk = _drive(DYADIC, reqs, aborts, bulk=True, seed=seed, policy="priority")
    assert len(step[0]) == len(reqs)
    assert bulk == step
    assert step[1]["num_preemptions_total"] > 0
    # The priorities change who waits and who is preempted.
    assert _drive(DYADIC, reqs, aborts, bulk=False, seed=seed)[0] != step[0]


def _metrics_over_time(reqs, bulk, seed, every=0.25):
    """The engine's counters (all but `now`) each time the clock reaches a multiple of `every`,
    the requests arriving as in `_drive`."""
    core = EngineCore(DYADIC, seed=seed, bulk=bulk)
    arrivals = _add_upfront(core, reqs)
    seen, t = [], 0.0
    while core.has_unfinished() or arrivals:
        t += every
        while arrivals and arrivals[0][0] <= t:
            at, spec = arrivals.pop(0)
            core.advance(at)
            core.add_request(EngineRequest(**spec))
        core.advance(t)
        counters = dataclasses.asdict(core.stats())
        counters["computed"] = core.computed_tokens()
        # (An arrival cuts a bulk decode run: the step in flight then is applied at once, so
        # the core is a step ahead until that step's end: such probes are left out.)
        if core.now <= t:
            del counters["now"]  # (bulk: where the run in flight started)
            seen.append((t, counters))
    return seen


@pytest.mark.parametrize("seed", range(3))
def test_metrics_mid_decode_run_are_those_of_the_steps_done(seed):
    """vLLM's /metrics count every step done: between the events that end a bulk decode run
    (a request finishing, an arrival), the KV in use, tokens generated and steps are those of
    the step-by-step path at the same time, not those of the run's start; so is the KV each
    request holds."""
    reqs, _ = _workload(seed)
    step = dict(_metrics_over_time(reqs, bulk=False, seed=seed))
    bulk = dict(_metrics_over_time(reqs, bulk=True, seed=seed))
    compared = bulk.keys() & step.keys()
    assert len(compared) >= 0.9 * len(step)
    assert {t: bulk[t] for t in compared} == {t: step[t] for t in compared}
    # (the workload has runs long enough for the probes to land inside them)
    assert len({c["kv_usage"] for c in step.values()}) > 20


@pytest.mark.parametrize("seed", [11, 12])
def test_bulk_advancing_equals_stepping_on_a_real_profile(seed):
    """The H100 profile's cost constants (not exact in binary), with a small KV cache and batch
    limits so that preemption happens: the same steps, tokens, hits and counters; times equal
    up to floating-point rounding (closed-form sums vs step-by-step sums)."""
    profile = dataclasses.replace(get_profile("h100-8b").with_kv_tokens(16 * 28), max_num_seqs=8,
                                  max_num_batched_tokens=256)
    reqs, aborts = _workload(seed)
    step = _drive(profile, reqs, aborts, bulk=False, seed=3)
    bulk = _drive(profile, reqs, aborts, bulk=True, seed=3)
    assert step[1]["num_preemptions_total"] > 0
    assert bulk[0].keys() == step[0].keys()
    for rid, (ft, reason, ttft, *rest) in step[0].items():
        bft, breason, bttft, *brest = bulk[0][rid]
        assert (breason, brest) == (reason, rest), rid
        assert bft == pytest.approx(ft, rel=1e-12)
        assert (bttft is None) == (ttft is None) and (ttft is None or bttft == pytest.approx(ttft, rel=1e-12))
    for k, v in step[1].items():
        if isinstance(v, float):
            assert bulk[1][k] == pytest.approx(v, rel=1e-12), k
        else:
            assert bulk[1][k] == v, k
