"""One way to apply a Decision: α, then recharges, then admissions, one refusal rule — the
pure planner, and the live broker's scripts agreeing with it on the same ledger."""

from __future__ import annotations

import pytest

from broker.decision import LedgerEntry, apply_decision, touched_backends
from broker.ledger import Ledger
from broker.keys import Keys
from broker.policies.base import Admission, Decision, Policy, Snapshot
from broker.worker_link import WorkerLink
from broker.heartbeat import EngineMetrics
from tests.broker.helpers import BrokerThread, make_session, wait_until


def ledger() -> dict[str, LedgerEntry]:
    return {"b0": LedgerEntry(capacity_tokens=100, alpha=1.0, sessions={"s0": 60})}


def the_decision() -> Decision:
    # α 1.2 → limit 120; s0 shrinks 60 → 30; then s1 (50) fits, s2 (50) would make 130.
    return Decision(admissions=[Admission("s1", "b0", 50), Admission("s2", "b0", 50)],
                    alpha={"b0": 1.2}, recharge={"s0": 30})


def test_order_is_alpha_then_recharges_then_admissions():
    led = ledger()
    out = apply_decision(the_decision(), led, enforce=True)
    assert [a.session_id for a in out.admissions] == ["s1"]
    assert out.refused == [("s2", "no_capacity")]
    assert out.recharge == {"s0": ("b0", 30)} and out.alpha == {"b0": 1.2}
    assert led["b0"].sessions == {"s0": 30, "s1": 50} and led["b0"].reserved_tokens == 80


def test_a_growing_recharge_past_the_limit_is_refused_a_shrinking_one_never():
    led = {"b0": LedgerEntry(capacity_tokens=100, sessions={"s0": 60, "s1": 30})}
    out = apply_decision(Decision(recharge={"s0": 71, "s1": 5}), led, enforce=True)
    assert out.refused == [("s0", "no_capacity")] and out.recharge == {"s1": ("b0", 5)}
    out = apply_decision(Decision(recharge={"s0": 95}), led, enforce=True)  # 95 + 5 = 100: fits
    assert out.recharge == {"s0": ("b0", 95)}


def test_a_router_baseline_is_charged_never_refused():
    led = ledger()
    out = apply_decision(Decision(admissions=[Admission("s1", "b0", 500)]), led, enforce=False)
    assert [a.session_id for a in out.admissions] == ["s1"] and led["b0"].reserved_tokens == 560


@pytest.mark.parametrize("adm, reason", [
    (Admission("s1", "nope", 1), "no_backend"), (Admission("s1", "sick", 1), "unhealthy"),
    (Admission("s1", "b0", -1), "bad_charge")])
def test_refusals_whatever_the_enforcement(adm, reason):
    led = {**ledger(), "sick": LedgerEntry(capacity_tokens=100, healthy=False)}
    assert apply_decision(Decision(admissions=[adm]), led, enforce=False).refused == [("s1", reason)]


class Scripted(Policy):
    """Admits s0 with 60 tokens first; once s1 and s2 are pending too, sends `the_decision`."""

    name = "scripted"

    def __init__(self) -> None:
        self.sent = False

    def decide(self, snapshot: Snapshot) -> Decision:
        pending = {p.session_id for items in snapshot.pending.values() for p in items}
        resident = {s.session_id for b in snapshot.backends for s in b.sessions}
        if "s0" in pending:
            return Decision(admissions=[Admission("s0", "b0", 60)])
        if not self.sent and {"s1", "s2"} <= pending and "s0" in resident:
            self.sent = True
            return the_decision()
        return Decision()


@pytest.mark.redis
def test_the_live_broker_applies_a_decision_as_the_planner_does(redis_url, namespace, redis_client):
    link = WorkerLink(redis_url, namespace, "b0", heartbeat_ttl_s=30.0)
    link.register(100, 4096)
    link.heartbeat(EngineMetrics(kv_usage=0.0, running=0, waiting=0, preemptions_total=0,
                                 prefix_queries_total=0, prefix_hits_total=0))
    from broker.client import RolloutClient
    client = RolloutClient(redis_url, namespace)
    policy = Scripted()
    broker = BrokerThread(redis_url, namespace, policy=policy).start()
    led = Ledger(redis_client, Keys(namespace))
    try:
        client.enqueue([make_session(0)])
        assert wait_until(lambda: led.read("b0").sessions == {"s0": 60})
        client.enqueue([make_session(1), make_session(2)])
        assert wait_until(lambda: policy.sent and led.read("b0").alpha == 1.2)
        assert wait_until(lambda: led.read("b0").sessions == {"s0": 30, "s1": 50})
        expected = ledger()
        apply_decision(the_decision(), expected, enforce=True)
        state = led.read("b0")
        assert state.sessions == expected["b0"].sessions
        assert state.reserved_tokens == expected["b0"].reserved_tokens
        assert redis_client.hget(Keys(namespace).session("s2"), "state") == b"pending"
    finally:
        broker.stop()
        client.close()
        link.close()


def test_kv_token_seconds_has_one_definition():
    from broker.policies.base import kv_token_seconds

    # Turn 1: 100-token prompt, 40 out over 2 s → 100·2 + 40·2/2 = 240. A 3 s tool wait on
    # the 140-token history → 420. Turn 2: 160-token prompt (+20 observed), 10 out over 1 s →
    # 160 + 5 = 165. Total 825.
    assert kv_token_seconds([(100, 40, 2.0), (160, 10, 1.0)], [(140, 3.0)]) == 825.0
    assert kv_token_seconds([]) == 0.0


def test_a_decision_touches_the_backends_of_its_alphas_admissions_and_recharges() -> None:
    d = Decision(admissions=[Admission("s1", "b1", 10)], recharge={"r2": 5, "r9": 7},
                 alpha={"b0": 0.9})
    touched, unknown = touched_backends(d, {"r2": "b2"}.get)
    assert (touched, unknown) == ({"b0", "b1", "b2"}, {"r9"})
