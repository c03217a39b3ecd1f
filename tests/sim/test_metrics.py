"""Every metric on numbers small enough to work out by hand (the arithmetic is in the comments)."""

import pytest

from broker.session import Session
from sim.metrics import (
    EngineCounters,
    IterationRecord,
    KvSample,
    SessionRecord,
    Trainer,
    first_tenth_speed,
    run_speed,
    kv_utilisation,
    latency_percentile,
    mean_iteration_time,
    mixture_drift,
    prefix_hit_rate,
    quotas,
    start_up_speed,
    summarize,
    throughput,
)
from sim.workloads import SessionTruth, SimSession
from sim.workloads.source import TraceSource


def rec(sid, workload="a", enq=0.0, fin=1.0, out=10):
    return SessionRecord(sid, workload, enq, enq, enq, fin, 5, out, 0, 1)


def it(index, start, done, **consumed):
    return IterationRecord(index, start, done, tuple(sorted(consumed.items())), ())


def test_throughput_counts_sessions_finished_in_the_span():
    sessions = [rec("x", fin=2, out=100), rec("y", fin=5, out=300), rec("z", fin=11, out=1000)]
    # Span [0, 10]: x and y finished in it → (100 + 300) / 10 = 40 tok/s, 2 / 10 = 0.2 sessions/s.
    assert throughput(sessions, 0.0, 10.0) == (40.0, 0.2)
    with pytest.raises(ValueError, match="span"):
        throughput(sessions, 5.0, 5.0)


def test_mean_iteration_time():
    # Durations 4 − 0 = 4 and 10 − 4 = 6 → mean 5.
    assert mean_iteration_time([it(0, 0, 4, a=1), it(1, 4, 10, a=1)]) == 5.0


def test_mixture_drift():
    # B = 8: |6/8 − 0.5| = 0.25, |2/8 − 0.3| = 0.05, |0 − 0.2| = 0.2 → ½ · 0.5 = 0.25.
    assert mixture_drift({"rlvr": 6, "rlhf": 2}, {"rlvr": 0.5, "rlhf": 0.3, "agentic": 0.2}) == pytest.approx(0.25)
    assert mixture_drift({"a": 5, "b": 5}, {"a": 0.5, "b": 0.5}) == 0.0
    assert mixture_drift({"c": 3}, {"a": 1.0}) == 1.0


def test_prefix_hit_rate_is_fleet_tokens_not_a_mean_of_rates():
    engines = [EngineCounters("e0", 1000, 600, 0), EngineCounters("e1", 3000, 400, 2)]
    # (600 + 400) / (1000 + 3000) = 0.25 (the mean of per-engine rates would be 0.367).
    assert prefix_hit_rate(engines) == 0.25
    assert prefix_hit_rate([]) == 0.0


def test_kv_utilisation_is_time_weighted():
    samples = [KvSample(4, "a", 1.0), KvSample(0, "a", 0.5), KvSample(2, "b", 0.4)]
    # [0, 8]: a = (0.5·4 + 1.0·4) / 8 = 0.75; b = (0·2 + 0.4·6) / 8 = 0.3 → mean 0.525.
    assert kv_utilisation(samples, 0, 8) == pytest.approx(0.525)
    # [2, 6]: a = (0.5·2 + 1.0·2) / 4 = 0.75; b = 0.4 → mean 0.575.
    assert kv_utilisation(samples, 2, 6) == pytest.approx(0.575)


def test_latency_percentiles_interpolate_linearly():
    sessions = [rec(str(i), enq=1.0, fin=1.0 + x) for i, x in enumerate([4, 1, 10, 2, 3])]
    # Sorted 1, 2, 3, 4, 10. p50 = 3. p99: rank 0.99·4 = 3.96 → 4 + 0.96·(10 − 4) = 9.76.
    assert latency_percentile(sessions, 50) == 3.0
    assert latency_percentile(sessions, 99) == pytest.approx(9.76)


def test_summarize_combines_the_definitions():
    sessions = [rec("x", "a", enq=0, fin=2, out=30), rec("y", "b", enq=1, fin=4, out=50)]
    m = summarize(sessions, [it(0, 0, 4, a=1, b=1)], [EngineCounters("e", 10, 5, 3)],
                  [KvSample(0, "e", 0.2)], {"a": 0.5, "b": 0.5}, 0.0, 4.0)
    # 80 tok / 4 s = 20; 2 / 4 = 0.5 sessions/s; latencies 2 and 3 → p50 2.5, p99 2 + 0.99 = 2.99.
    assert (m.tokens_per_s, m.sessions_per_s, m.mean_iteration_s) == (20.0, 0.5, 4.0)
    assert (m.mean_drift, m.prefix_hit_rate, m.preemptions, m.kv_utilisation) == (0.0, 0.5, 3, 0.2)
    assert (m.latency_p50_s, m.latency_p99_s) == (2.5, pytest.approx(2.99))


def test_cold_start_ends_when_each_workloads_first_fill_has_turned_over():
    # First fill at t=0: a ×2, b ×1. a's 2nd return is at 5, b's 1st at 3 → warm from t=5.
    sessions = [rec("a1", "a", enq=0, fin=1, out=10), rec("b1", "b", enq=0, fin=3, out=20),
                rec("a2", "a", enq=0, fin=5, out=30), rec("a3", "a", enq=1, fin=7, out=40),
                rec("b2", "b", enq=3, fin=9, out=50), rec("a4", "a", enq=5, fin=10, out=60)]
    its = [it(0, 0, 3, a=1, b=1), it(1, 3, 7, a=2), it(2, 7, 10, a=1, b=1)]
    samples = [KvSample(0, "e", 0.5, 0), KvSample(4, "e", 0.5, 7), KvSample(8, "e", 0.5, 9)]
    m = summarize(sessions, its, [EngineCounters("e", 1, 1, 9)], samples, {"a": 0.5, "b": 0.5},
                  0.0, 10.0, batch_size=2)
    assert (m.cold.start, m.cold.end, m.steady.start, m.steady.end) == (0.0, 5.0, 5.0, 10.0)
    # cold [0, 5]: a1, b1, a2 → 60 tok / 5 s = 12; its 0 (done 3) only; preemptions 7 − 0.
    assert (m.cold.tokens_per_s, m.cold.iterations, m.cold.preemptions) == (12.0, 1, 7)
    # steady (5, 10]: a3, b2, a4 → 150 / 5 = 30; its 1, 2 (4 s, 3 s); preemptions 9 − 7 = 2.
    assert (m.steady.tokens_per_s, m.steady.iterations, m.steady.mean_iteration_s) == (30.0, 2, 3.5)
    assert m.steady.preemptions == 2
    # drifts: it0 0, it1 ½(|1−½| + |0−½|) = ½, it2 0 → steady mean ¼.
    assert m.steady.mean_drift == pytest.approx(0.25) and m.drift.steady == pytest.approx(0.25)
    # 3 returned after warm-up / 3 in the first fill = 1 turnover: too short, and it says so.
    assert m.steady_turnovers == 1.0
    assert any("short steady state" in w for w in m.warnings)


def test_summarize_records_when_each_iteration_completed():
    sessions = [rec("x", "a", enq=2, fin=4), rec("y", "a", enq=2, fin=9)]
    m = summarize(sessions, [it(0, 2, 4, a=1), it(1, 4, 9, a=1)], [], [], {"a": 1.0}, 2.0, 9.0)
    assert m.iteration_done_s == (2.0, 7.0)  # from the trainer's start at 2


class _Cold:
    def __init__(self, iterations):
        self.iterations = iterations


class _Metrics:  # the two fields start_up_speed reads
    def __init__(self, cold_iterations, done):
        self.cold = _Cold(cold_iterations)
        self.iteration_done_s = done


def test_start_up_speed_compares_the_same_first_iterations():
    # Baselines finished 3 and 5 iterations in their cold starts: k = 3. The quickest baseline
    # reached its 3rd iteration at 28 s, the policy at 21 s: 28 / 21.
    a = _Metrics(3, (10.0, 20.0, 30.0, 40.0))
    b = _Metrics(5, (5.0, 15.0, 28.0, 35.0, 50.0))
    assert start_up_speed(_Metrics(2, (8.0, 14.0, 21.0, 60.0)), [a, b]) == pytest.approx(28 / 21)
    assert start_up_speed(b, [a, b]) == 1.0  # the quickest baseline against itself
    assert start_up_speed(_Metrics(1, (8.0, 14.0)), [a, b]) is None  # it never got to k
    assert start_up_speed(a, []) is None


def test_no_steady_state_is_said_not_hidden():
    # b's only first-fill session never returns within the run.
    sessions = [rec("a1", "a", enq=0, fin=1), rec("a2", "a", enq=1, fin=2)]
    m = summarize(sessions, [it(0, 0, 2, a=2)], [], [], {"a": 0.5, "b": 0.5}, 0.0, 2.0,
                  first_fill={"a": 1, "b": 1})
    assert m.steady is None and m.cold.end == 2.0
    assert any("no steady state" in w for w in m.warnings)


def test_drift_is_taken_apart():
    # b's first result is at 6: iterations done before it are start-up.
    sessions = [rec("a1", "a", fin=1), rec("a2", "a", fin=2), rec("b1", "b", fin=6),
                rec("a3", "a", fin=7)]
    its = [it(0, 0, 2, a=2), it(1, 2, 7, a=1, b=1)]
    m = summarize(sessions, its, [], [], {"a": 0.5, "b": 0.5}, 0.0, 7.0, batch_size=2)
    assert m.drift.startup == pytest.approx(0.5)  # it0 holds only a: ½(½ + ½)
    assert m.drift.cumulative == pytest.approx(0.25)  # a 3, b 1 of 4: ½(|¾−½| + |¼−½|)
    # Two draws from ½/½: half the time both the same (drift ½), half split (0) → ¼.
    assert m.drift.floor == pytest.approx(0.25, abs=0.01)


def test_the_multinomial_floor_shrinks_with_the_batch():
    from sim.metrics import multinomial_drift_floor
    pi = {"rlvr": 0.5, "rlhf": 0.3, "agentic": 0.2}
    small, large = multinomial_drift_floor(128, pi), multinomial_drift_floor(2048, pi)
    assert 0.04 < small < 0.06 and 0.01 < large < 0.015  # ~1/√B
    assert multinomial_drift_floor(128, pi) == small  # a fixed seed: the same number twice


def test_quotas_by_largest_remainder():
    assert quotas(10, {"a": 0.5, "b": 0.3, "c": 0.2}) == {"a": 5, "b": 3, "c": 2}
    # 8 → 4, 2.4, 1.6: floors 4 + 2 + 1 = 7; the one left goes to the largest remainder (c, .6).
    assert quotas(8, {"a": 0.5, "b": 0.3, "c": 0.2}) == {"a": 4, "b": 2, "c": 2}
    # 3 → 1.5, 1.5: tie → the first name.
    assert quotas(3, {"b": 0.5, "a": 0.5}) == {"a": 2, "b": 1}


def _sim(workload, group, member, size):
    sid = f"{workload}{group}-{member}"
    session = Session(session_id=sid, workload=workload, group_id=f"{workload}{group}",
                      group_size=size, prompt_token_ids=[1, 2, 3], max_tokens=8)
    truth = SessionTruth((4,), (False,), (), (), 0.0, 1, 100)
    return SimSession(session=session, truth=truth)


class FakeSource:
    """Workload a comes in groups of 2, b in groups of 1; `limit` groups of each."""

    def __init__(self, limit=100):
        self.drawn = {"a": 0, "b": 0}
        self.limit = limit

    def next_group(self, w):
        i = self.drawn[w]
        if i >= self.limit:
            return None
        self.drawn[w] += 1
        size = 2 if w == "a" else 1
        return tuple(_sim(w, i, m, size) for m in range(size))

    def recorded(self):
        return ()


def _ids(sessions):
    return [s.session_id for s in sessions]


def test_fifo_trainer_refills_the_buffer_in_mixture_order():
    t = Trainer(FakeSource(), mode="fifo", batch_size=2, mixture={"a": 0.5, "b": 0.5},
                inflight_bound=4, iterations=3)
    # Keys (enqueued_w + group) / π_w: b 2 < a 4 → b0; a 4 = b 4 → a0 (name); b 4 < a 8 → b1;
    # then b2 would make 5 > 4 outstanding → stop.
    assert _ids(t.enqueue(0.0)) == ["b0-0", "a0-0", "a0-1", "b1-0"]
    assert t.outstanding == 4
    assert t.on_result(rec("a0-1", "a"), 1.0) == []
    (first,) = t.on_result(rec("b0-0", "b"), 2.0)
    assert (first.index, first.started_at, first.done_at) == (0, 0.0, 2.0)
    assert first.consumed == (("a", 1), ("b", 1)) and first.session_ids == ("a0-1", "b0-0")
    # 2 outstanding: b2 (key 6 < 8) fits; then a1 (tie at 8, name) needs 2 more → 5 > 4, stop.
    assert _ids(t.enqueue(2.0)) == ["b2-0"]
    assert t.consumed == {"a": 1, "b": 1}


def test_fifo_trainer_keeps_the_buffer_full_until_done_then_stops():
    t = Trainer(FakeSource(), mode="fifo", batch_size=2, mixture={"a": 0.5, "b": 0.5},
                inflight_bound=5, iterations=1)
    # Keys (enqueued_w + group) / π_w: b0 (2 < 4); a0 (4 = 4, name first); b1 (4 < 8);
    # b2 (6 < 8) fills the buffer to 5; then a1 (8 = 8, name) would need 7 > 5: stop.
    assert _ids(t.enqueue(0.0)) == ["b0-0", "a0-0", "a0-1", "b1-0", "b2-0"]
    t.on_result(rec("b0-0", "b"), 1.0)
    # One slot free: a1 comes first (8 = 8, name) but is a group of 2 — never split — so nothing.
    assert t.enqueue(1.0) == []
    t.on_result(rec("a0-0", "a"), 2.0)
    assert t.done and t.enqueue(3.0) == []
    assert t.on_result(rec("a0-1", "a"), 4.0) == [] and len(t.iterations) == 1


def test_quota_trainer_waits_for_each_workload_and_keeps_extras():
    t = Trainer(FakeSource(), mode="quota", batch_size=4, mixture={"a": 0.5, "b": 0.5},
                inflight_bound=100, iterations=2)
    assert t.quota == {"a": 2, "b": 2}
    for i, sid in enumerate(["a0-0", "a0-1", "a1-0"]):
        assert t.on_result(rec(sid, "a"), float(i)) == []
    assert t.on_result(rec("b0-0", "b"), 3.0) == []
    (first,) = t.on_result(rec("b1-0", "b"), 4.0)
    assert first.session_ids == ("a0-0", "a0-1", "b0-0", "b1-0")
    # a1-0 is kept: the next iteration needs one more a and two b.
    t.on_result(rec("b2-0", "b"), 5.0)
    t.on_result(rec("b3-0", "b"), 6.0)
    (second,) = t.on_result(rec("a1-1", "a"), 7.0)
    assert second.session_ids == ("a1-0", "a1-1", "b2-0", "b3-0")
    assert (second.started_at, second.done_at, second.duration) == (4.0, 7.0, 3.0)
    assert t.done and t.consumed == {"a": 4, "b": 4}


def test_quota_trainer_fills_its_buffer_in_target_proportions():
    t = Trainer(FakeSource(), mode="quota", batch_size=4, mixture={"a": 0.5, "b": 0.5},
                inflight_bound=8, iterations=2)
    sessions = t.enqueue(0.0)
    # Eight slots, π = ½/½: a in two groups of 2, b in four groups of 1.
    assert t.enqueued == {"a": 4, "b": 4} and len(sessions) == 8


def test_trainer_stalls_when_a_finite_source_runs_dry():
    src = TraceSource([_sim("b", 0, 0, 1)])
    t = Trainer(src, mode="fifo", batch_size=2, mixture={"b": 1.0}, inflight_bound=4, iterations=1)
    assert _ids(t.enqueue(0.0)) == ["b0-0"]
    assert not t.stalled()  # one result still outstanding
    t.on_result(rec("b0-0", "b"), 1.0)
    assert t.stalled() and not t.done


def test_sync_trainer_runs_one_whole_step_at_a_time():
    t = Trainer(FakeSource(), mode="fifo", batch_size=4, mixture={"a": 0.5, "b": 0.5},
                inflight_bound=4, iterations=2, loop="sync", train_s=10.0)
    step = _ids(t.enqueue(0.0))
    # quota 2 + 2: a in one group of 2, b in two groups of 1
    assert step == ["a0-0", "a0-1", "b0-0", "b1-0"]
    assert t.enqueue(0.5) == []  # nothing more until this step is done and trained on
    for i, sid in enumerate(step[:-1]):
        assert t.on_result(rec(sid, sid[0]), float(i)) == []
    (first,) = t.on_result(rec("b1-0", "b"), 5.0)
    assert first.session_ids == tuple(step) and first.done_at == 5.0
    assert t.next_arrival_at() == 15.0 and t.enqueue(14.0) == []  # training
    assert _ids(t.enqueue(15.0)) == ["a1-0", "a1-1", "b2-0", "b3-0"]


def test_a_staleness_bound_holds_the_producer_to_k_iterations_ahead():
    t = Trainer(FakeSource(), mode="fifo", batch_size=2, mixture={"a": 0.5, "b": 0.5},
                inflight_bound=100, iterations=10, max_staleness=1)
    # (0 done + 1 + 1) · 2 = 4 sessions at most before the first iteration is consumed
    assert len(t.enqueue(0.0)) == 4 and t.outstanding == 4
    t.on_result(rec("b0-0", "b"), 1.0)
    t.on_result(rec("a0-0", "a"), 2.0)  # iteration 1 done: up to 6 in all now
    # b2 (key 6 < 8) fits; then a1 (a group of 2, never split) would make 7 > 6: stop.
    assert _ids(t.enqueue(2.0)) == ["b2-0"] and sum(t.enqueued.values()) == 5
    unbounded = Trainer(FakeSource(), mode="fifo", batch_size=2, mixture={"a": 0.5, "b": 0.5},
                        inflight_bound=100, iterations=10)
    assert len(unbounded.enqueue(0.0)) > 10


def test_the_first_tenth_of_a_run_is_its_first_ceil_10_percent_of_iterations():
    a = _Metrics(1, (10.0, 20.0, 30.0, 40.0))
    b = _Metrics(1, (12.0, 18.0, 33.0, 44.0))
    policy = _Metrics(1, (9.0, 24.0, 30.0, 41.0))
    assert first_tenth_speed(policy, [a, b], iterations=4) == pytest.approx(10 / 9)  # k = 1
    assert first_tenth_speed(policy, [a, b], iterations=11) == pytest.approx(18 / 24)  # k = 2
    assert first_tenth_speed(policy, [a, b], iterations=50) is None  # k = 5: nobody got there


def test_run_speed_compares_the_time_to_the_last_iteration():
    a = _Metrics(1, (10.0, 20.0, 30.0, 40.0))
    b = _Metrics(1, (12.0, 18.0, 33.0, 44.0))
    assert run_speed(_Metrics(1, (9.0, 24.0, 30.0, 50.0)), [a, b], iterations=4) == 40 / 50
    assert run_speed(b, [a, b], iterations=4) == 40 / 44
    assert run_speed(_Metrics(1, (9.0, 24.0, 30.0)), [a, b], iterations=4) is None  # cut short
