"""Models and LoRA adapters in placement: every policy places a session only on an engine that
serves its model (and LoRA, for an adapter); MISA-T also keeps each engine's adapters within
its `max_loras` slots and sends an adapter's sessions where it is already held or loaded."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from broker.policies import make_policy
from broker.policies.base import BackendView, PendingItem, ResidentSession, Snapshot, serves

POLICIES = ("round_robin", "least_loaded", "power_of_two", "cache_aware", "misa_t")
CAP = 100_000


def pending(sid: str, *, model: str | None = None, adapter: str | None = None,
            workload: str = "rlhf", at: float = 0.0, prompt: int = 100,
            max_tokens: int = 500) -> PendingItem:
    return PendingItem(session_id=sid, workload=workload, group_id=None, group_size=1,
                       prompt_tokens=prompt, prefix=tuple(range(prompt)), max_tokens=max_tokens,
                       max_turns=1, turn=0, home_backend=None, enqueued_at=at, model=model,
                       adapter=adapter)


def resident(sid: str, adapter: str | None = None) -> ResidentSession:
    return ResidentSession(session_id=sid, workload="rlhf", group_id=None, reserved_tokens=600,
                           prompt_tokens=100, context_tokens=100, generated_tokens=0, turn=1,
                           max_tokens=500, max_turns=1, waiting_on_tool=False, admitted_at=0.0,
                           adapter=adapter)


def view(bid: str, model: str | None, max_loras: int = 0, *sessions: ResidentSession,
         loaded: frozenset[str] = frozenset(), capacity: int = CAP) -> BackendView:
    return BackendView(backend_id=bid, capacity_tokens=capacity, max_model_len=capacity,
                       healthy=True, alpha=1.0, telemetry=None, sessions=tuple(sessions),
                       model=model, max_loras=max_loras, adapters=loaded)


def snap(backends: list[BackendView], items: list[PendingItem]) -> Snapshot:
    by_w: dict[str, list[PendingItem]] = {}
    for it in items:
        by_w.setdefault(it.workload, []).append(it)
    return Snapshot(now=0.0, pending={w: tuple(v) for w, v in by_w.items()},
                    backends=tuple(backends), mixture_target={"rlhf": 1.0}, consumed={})


def placed(policy: str, s: Snapshot) -> dict[str, str]:
    return {a.session_id: a.backend_id for a in make_policy(policy).decide(s).admissions}


def random_case(rng: random.Random, n_backends: int) -> tuple[list[BackendView], list[PendingItem]]:
    backends = []
    for i in range(n_backends):
        model = rng.choice(("m-a", "m-b")) if i else "m-a"
        max_loras = rng.choice((0, 1, 2)) if model != "m-a" else 0
        residents = [resident(f"b{i}-r{j}", rng.choice(("x", "y", "z", None)) if max_loras
                              else None)
                     for j in range(rng.randrange(max_loras + 1))]
        # Never more adapters resident than slots: the state MISA-T keeps.
        while len({r.adapter for r in residents if r.adapter}) > max_loras:
            residents.pop()
        backends.append(view(f"b{i}", model, max_loras, *residents,
                             loaded=frozenset(rng.sample(("x", "y", "z"), rng.randrange(3)))
                             if max_loras else frozenset(),
                             capacity=rng.choice((20_000, CAP))))
    items = []
    for j in range(rng.randrange(1, 60)):
        model = rng.choice((None, "m-a", "m-b", "m-c"))
        adapter = rng.choice((None, "x", "y", "z")) if model != "m-a" else None
        items.append(pending(f"s{j}", model=model, adapter=adapter, at=j))
    return backends, items


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(12))
def test_a_session_runs_only_where_its_model_and_lora_are_served(policy, seed):
    rng = random.Random(seed)
    backends, items = random_case(rng, rng.choice((3, 8, 140)))  # 140: MISA-T's array path
    by_id = {b.backend_id: b for b in backends}
    by_item = {it.session_id: it for it in items}
    got = placed(policy, snap(backends, items))
    for sid, b in got.items():
        assert serves(by_id[b], by_item[sid]), (sid, by_item[sid], by_id[b])
    assert not any(by_item[s].model == "m-c" for s in got)  # nobody serves it


@pytest.mark.parametrize("seed", range(12))
def test_misa_t_keeps_each_engines_adapters_within_its_slots(seed):
    rng = random.Random(100 + seed)
    backends, items = random_case(rng, rng.choice((3, 8, 140)))
    got = placed("misa_t", snap(backends, items))
    adapter_of = {it.session_id: it.adapter for it in items}
    for b in backends:
        held = {s.adapter for s in b.sessions if s.adapter}
        held |= {adapter_of[sid] for sid, on in got.items() if on == b.backend_id
                 and adapter_of[sid]}
        assert len(held) <= b.max_loras, (b.backend_id, held, b.max_loras)


def test_the_slot_rule_is_what_keeps_adapters_apart():
    """Two adapters, two one-slot engines: MISA-T puts each adapter on an engine of its own;
    a router, which leaves slots to the engine, mixes them."""
    backends = [view("b0", "m", 1), view("b1", "m", 1)]
    items = [pending(f"s{i}", model="m", adapter="xy"[i // 2 % 2], at=i) for i in range(8)]
    got = placed("misa_t", snap(backends, items))
    assert len(got) == 8
    for b in ("b0", "b1"):
        assert len({items[int(s[1:])].adapter for s, on in got.items() if on == b}) == 1
    rr = placed("round_robin", snap(backends, items))
    assert len({items[int(s[1:])].adapter for s, on in rr.items() if on == "b0"}) == 2


def test_misa_t_sends_an_adapter_where_it_is_loaded():
    empty = [view(f"b{i}", "m", 2) for i in range(3)]
    backends = [*empty, view("b3", "m", 2, loaded=frozenset({"x"}))]
    got = placed("misa_t", snap(backends, [pending("s0", model="m", adapter="x")]))
    assert got == {"s0": "b3"}
    # Not without LoRA: an engine with it loaded but no slot free takes none.
    full = view("b3", "m", 1, resident("r", "y"), loaded=frozenset({"x"}))
    got = placed("misa_t", snap([*empty, full], [pending("s0", model="m", adapter="x")]))
    assert got["s0"] != "b3"


def test_a_session_no_engine_serves_does_not_hold_back_the_queue():
    backends = [view("b0", "m-a"), view("b1", "m-a")]
    items = [pending("lost", model="m-z", at=0), pending("s1", model="m-a", at=1),
             pending("s2", at=2), pending("lora", model="m-a", adapter="x", at=3)]
    for policy in POLICIES:
        got = placed(policy, snap(backends, items))
        assert set(got) == {"s1", "s2"}, policy


def test_a_backend_that_reports_no_model_serves_any():
    got = placed("misa_t", snap([view("b0", None)], [pending("s", model="anything")]))
    assert got == {"s": "b0"}
    item = pending("s", model="m", adapter="x")
    assert not serves(view("b0", "m", 0), item)
    assert serves(view("b0", "m", 1), item)
    assert not serves(view("b0", "other", 1), item)
    assert serves(view("b0", "other", 1), replace(item, model=None))


def test_a_session_whose_adapter_has_no_slot_lets_the_others_go_ahead():
    """Both one-slot engines hold other adapters: z waits, and the x and y sessions behind it
    are placed (as vLLM's scheduler runs the requests behind one whose adapter has no slot)."""
    backends = [view("b0", "m", 1, resident("r0", "x")), view("b1", "m", 1, resident("r1", "y"))]
    items = [pending("z0", model="m", adapter="z", at=0), pending("x1", model="m", adapter="x", at=1),
             pending("y2", model="m", adapter="y", at=2)]
    assert placed("misa_t", snap(backends, items)) == {"x1": "b0", "y2": "b1"}


def multi_turn(sid: str, **kw) -> PendingItem:
    return replace(pending(sid, **kw), max_turns=2)


def test_a_session_whose_model_is_full_lets_the_other_models_sessions_go():
    """The m-a engine has no room for the oldest session (an m-a one): the m-b session behind
    it goes to the m-b engine, as it would from that engine's own queue behind a router. The
    m-a session behind the oldest does not overtake it on the m-a engine, though it would fit
    there. (Multi-turn sessions: admission is closed, the ledger's α = 1 binds.)"""
    backends = [view("ba", "m-a", 0, resident("r0"), capacity=1_000),
                view("bb", "m-b", 0, capacity=1_000)]
    items = [multi_turn("a0", model="m-a", at=0, prompt=300, max_tokens=300),
             multi_turn("b1", model="m-b", at=1, prompt=100, max_tokens=200),
             multi_turn("a2", model="m-a", at=2, prompt=100, max_tokens=100)]
    assert placed("misa_t", snap(backends, items)) == {"b1": "bb"}


def test_a_session_that_may_run_anywhere_still_stops_its_workload():
    """FIFO within a workload where the oldest could use every engine: nothing behind it goes,
    whichever model it names."""
    backends = [view("ba", "m-a", 0, resident("r0"), capacity=1_000),
                view("bb", "m-b", 0, resident("r1"), capacity=1_000)]
    items = [multi_turn("any0", at=0, prompt=300, max_tokens=300),
             multi_turn("b1", model="m-b", at=1, prompt=100, max_tokens=100)]
    assert placed("misa_t", snap(backends, items)) == {}
