"""Scheduler: token budget, max_num_seqs, FCFS admission, chunked prefill, which request is
preempted and how its recompute reuses its surviving prefix blocks.

Most cases use a profile whose steps last exactly one virtual second (t0 = 1, no other cost),
so virtual time equals the step count and expected times can be worked out by hand.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.engine.core import EngineCore
from sim.engine.profiles import get_profile
from sim.engine.request import EngineRequest, FinishReason

BS = 16
# 8 usable blocks (block 0 is the null block), 32 tokens per step, 4 sequences.
ONE_SEC = dataclasses.replace(get_profile("h100-8b"), kv_tokens=16 * 9, max_num_batched_tokens=32,
                              max_num_seqs=4, t0=1.0, t_seq=0, a=0, b=0, c=0)


def trace(core: EngineCore):
    """Drive the step-by-step engine; yield (start time, ScheduledStep) for every step."""
    while core.has_unfinished():
        t = core.next_event_time()
        if t is None:
            break
        core.advance(t)
        core.check_invariants()
        plan = core._plan
        if plan is not None:
            yield plan.start, plan.step


def req(rid, prompt, out, max_tokens=None, at=0.0, **kw):
    return EngineRequest(rid, list(prompt), max_tokens or out, output_len=out, arrival_time=at, **kw)


def test_chunked_prefill_of_a_long_prompt():
    core = EngineCore(ONE_SEC, bulk=False)
    core.add_request(req("p", range(1, 101), 3))
    chunks = [[(r.request_id, n) for r, n in step.scheduled] for _, step in trace(core)]
    # 100 tokens under a 32-token budget: 32, 32, 32, 4; then 2 decodes for outputs 2 and 3.
    assert chunks == [[("p", 32)], [("p", 32)], [("p", 32)], [("p", 4)], [("p", 1)], [("p", 1)]]
    core.run_until_idle()
    assert core.stats().steps_total == 6


@settings(deadline=None, derandomize=True, max_examples=25)
@given(specs=st.lists(st.tuples(st.integers(1, 90), st.integers(1, 40), st.integers(0, 12)),
                      min_size=1, max_size=12))
def test_budget_and_max_num_seqs_hold_every_step(specs):
    core = EngineCore(ONE_SEC, bulk=False)
    for i, (plen, out, at) in enumerate(specs):
        core.add_request(req(f"r{i}", [(i * 7 + j) % 50 for j in range(plen)], out, at=float(at)))
    steps = 0
    for _, step in trace(core):
        steps += 1
        assert sum(n for _, n in step.scheduled) <= ONE_SEC.max_num_batched_tokens
        assert len(step.scheduled) <= ONE_SEC.max_num_seqs
        assert len({r.request_id for r, _ in step.scheduled}) == len(step.scheduled)
        assert all(n >= 1 for _, n in step.scheduled)
    assert core.stats().requests_finished_total[FinishReason.stop] + \
        core.stats().requests_finished_total[FinishReason.length] == len(specs)
    assert steps == core.stats().steps_total


def test_admission_is_fcfs_and_stops_at_the_first_request_that_does_not_fit():
    core = EngineCore(ONE_SEC, bulk=False)
    # R: 100-token prompt, prefilled in steps 0–3 (32+32+32+4) into 7 blocks (112 slots), and
    # 5 outputs (first at t=4, then steps 4–7) → finishes at t=8 without needing an 8th block.
    scheduled_reqs = []
    core.add_request(req("R", range(1, 101), 5))
    # At t=4: W1 (40 tokens) would take a 31-token chunk = 2 blocks, but 1 block is free;
    # W2 (10 tokens, 1 block) would fit, yet FCFS stops at W1.
    core.add_request(req("W1", range(200, 240), 2, at=4.0))
    core.add_request(req("W2", range(300, 310), 2, at=4.0))
    seen = {}
    for start, step in trace(core):
        scheduled_reqs += [r for r, _ in step.scheduled if r not in scheduled_reqs]
        seen[start] = [(r.request_id, n) for r, n in step.scheduled]
        if start == 4.0:
            w2 = core.scheduler.waiting[1]
            assert w2.request_id == "W2"
            assert core.kv.pool.num_free == 1 and core.kv.can_allocate(w2, 10)
    for t in (4.0, 5.0, 6.0, 7.0):
        assert seen[t] == [("R", 1)]
    # t=8: R has freed its blocks; W1 takes the whole budget (32), W2 gets nothing.
    assert seen[8.0] == [("W1", 32)]
    # t=9: W1's last 8 tokens, then W2's prompt.
    assert seen[9.0] == [("W1", 8), ("W2", 10)]
    done = {r.request_id: r for r in scheduled_reqs}
    assert core.stats().num_preemptions_total == 0
    # W1: 1st output at t=10, 2nd at t=11; W2 likewise (its 10 tokens ran at t=9).
    assert (done["W1"].finish_time, done["W2"].finish_time, done["R"].finish_time) == (11.0, 11.0, 8.0)


def test_the_last_running_request_is_preempted_and_recompute_reuses_its_prefix():
    """Worked by hand (1-second steps, 8 usable blocks, 32-token budget).

    A: 32-token prompt, ignore_eos, max_tokens 40.   B: another 32-token prompt, output_len 40.
    Free queue starts 1..8.
    t=0  A prefills 32 tokens → blocks 1,2.                      (B: budget left 0)
    t=1  A decodes (33 tokens → block 3); B admitted: 31-token chunk → blocks 4,5.
    t=2  A decodes; B's last prompt token (its 2nd block is cached now). B's 1st token at t=3.
    t=3  B needs block 6 (33 tokens).                             free 2
    A's num_tokens at the start of step s is 32+s; B's is 30+s (s ≥ 3).
    t=17 A needs block 7 (49 tokens); t=19 B needs block 8.       free 0
    t=33 A needs a 5th block (65 tokens): B, the last running, is preempted. B had 63 tokens
         (31 outputs), 62 computed → 3 full blocks cached, freed tail-first: 8, 6, 5, 4.
         A takes block 8 (B's unhashed partial block). No admission in a preempting step.
    t=34…39  B waits: it would hit 3 blocks (48 tokens) but needs them + 1 new = 4 > 3 free.
    t=40 A finishes (40 outputs: 1 at t=1, one per step 1…39). B resumes: hits 48 tokens
         (blocks 4,5,6 survived), recomputes 63 − 48 = 15 tokens → its 32nd output at t=41.
    t=41…48  8 decodes → B's 40th output at t=49.   Steps: 49, preemptions: 1.
    """
    core = EngineCore(ONE_SEC, bulk=False)
    a = EngineRequest("A", list(range(1, 33)), 40, ignore_eos=True, output_len=5)
    b = EngineRequest("B", list(range(101, 133)), 64, output_len=40)
    core.add_request(a)
    core.add_request(b)
    steps, held = {}, {}
    for start, step in trace(core):
        steps[start] = step
        held[start] = ([blk.block_id for blk in a.blocks], [blk.block_id for blk in b.blocks])
    pre = steps[33.0]
    assert [r.request_id for r in pre.preempted] == ["B"]
    assert [(r.request_id, n) for r, n in pre.scheduled] == [("A", 1)]
    assert held[33.0] == ([1, 2, 3, 7, 8], [])
    assert all([(r.request_id, n) for r, n in steps[t].scheduled] == [("A", 1)] for t in range(34, 40))
    resume = steps[40.0]
    assert [(r.request_id, n) for r, n in resume.scheduled] == [("B", 15)]
    assert resume.lookups == [(63, 48, True)]
    # B's surviving blocks come back; its 4th is the LRU head (A's partial block 8 went last).
    assert held[40.0][1][:3] == [4, 5, 6] and len(held[40.0][1]) == 4
    assert (a.finish_time, a.finish_reason, a.num_output_tokens) == (40.0, FinishReason.length, 40)
    assert (b.finish_time, b.finish_reason, b.num_output_tokens) == (49.0, FinishReason.stop, 40)
    assert (b.num_preemptions, b.num_cached_tokens) == (1, 0)  # cached_tokens: first admission
    s = core.stats()
    assert (s.steps_total, s.num_preemptions_total) == (49, 1)
    assert (s.prefix_queries_total, s.prefix_hits_total) == (64, 0)
    assert (s.preempted_prefix_queries_total, s.preempted_prefix_hits_total) == (63, 48)
    assert (s.prompt_tokens_total, s.generation_tokens_total) == (64, 80)
    assert s.busy_time == 49.0 and s.kv_usage == 0.0


def test_under_priority_the_lowest_priority_request_is_preempted():
    """The hand-worked case above under `--scheduling-policy priority`, with B ahead of A by
    priority and arriving at t=1, when the budget first admits it: the steps are the same up
    to t=33, where A needs a block. A is the lowest priority, so A is preempted, not B (the
    last running): A preempted itself, so that step schedules nothing (vLLM returns it empty,
    here a step of no time). B decodes on alone to its 40th output at t=42 (FCFS: t=49); A
    resumes after it, and its 40th output comes at t=49."""
    core = EngineCore(ONE_SEC, bulk=False, scheduling_policy="priority")
    a = EngineRequest("A", list(range(1, 33)), 40, ignore_eos=True, output_len=5, priority=1)
    b = EngineRequest("B", list(range(101, 133)), 64, output_len=40, arrival_time=1.0)
    core.add_request(a)
    core.add_request(b)
    running = {t: [r.request_id for r in core.scheduler.running] for t, _ in trace(core)}
    assert running[32.0] == ["A", "B"] and running[33.0] == ["B"]
    assert (a.num_preemptions, b.num_preemptions) == (1, 0)
    assert (b.finish_time, a.finish_time) == (42.0, 49.0)
    assert core.stats().num_preemptions_total == 1


@settings(deadline=None, derandomize=True, max_examples=30)
@given(specs=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 60), st.integers(0, 6),
                                st.integers(0, 3)), min_size=2, max_size=10))
def test_under_priority_no_request_left_running_ranks_below_a_victim(specs):
    """Whatever a step preempts, every request still running after it comes first by
    (priority, arrival time, order added); a victim scheduled earlier in the step is taken out
    of it; waiting stays in that order."""
    core = EngineCore(ONE_SEC, bulk=False, scheduling_policy="priority")
    for i, (plen, out, at, prio) in enumerate(specs):
        core.add_request(req(f"r{i}", [(i * 11 + j) % 50 for j in range(plen)], out, at=float(at),
                             priority=prio))
    for _, step in trace(core):
        victims = {id(r) for r in step.preempted}
        assert not any(id(r) in victims for r, _ in step.scheduled)
        assert sum(n for _, n in step.scheduled) <= ONE_SEC.max_num_batched_tokens
        for v in step.preempted:
            assert all((r.priority, r.arrival_time, r.arrival_seq)
                       < (v.priority, v.arrival_time, v.arrival_seq)
                       for r in core.scheduler.running)
        order = [(r.priority, r.arrival_time, r.arrival_seq) for r in core.scheduler.waiting]
        assert order == sorted(order)
    assert core.stats().requests_finished_total[FinishReason.stop] + \
        core.stats().requests_finished_total[FinishReason.length] == len(specs)


def test_an_unknown_scheduling_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineCore(ONE_SEC, scheduling_policy="lifo")


@pytest.mark.parametrize("bulk", [False, True])
def test_last_prompt_block_of_a_one_token_chunk_is_hit_in_the_same_step(bulk):
    """R decodes alongside A, so A's 32-token prompt is prefilled as 31 + 1 tokens (t=1, t=2).
    B (A's prompt + 16 tokens) is admitted at t=2 right after A's 1-token chunk: as in vLLM,
    allocation cached A's 2nd block, so B hits both (32 tokens; its cap is 47)."""
    core = EngineCore(ONE_SEC, bulk=bulk)
    prompt = list(range(100, 132))
    core.add_request(req("R", [1, 2, 3, 4], 20))
    core.add_request(req("A", prompt, 5, at=1.0))
    core.add_request(req("B", prompt + list(range(200, 216)), 5, at=2.0))
    done = {r.request_id: r for r in core.run_until_idle()}
    assert done["B"].num_cached_tokens == 32
    # B: 16 tokens at t=2 → 1st output at t=3, 5th at t=7.
    assert done["B"].finish_time == 7.0 and done["A"].finish_time == 7.0
