"""broker/shares.py: parsing guaranteed shares and each namespace's part of a shared engine."""

from __future__ import annotations

import pytest

from broker.heartbeat import EngineMetrics, HeartbeatRecord, SharedPart
from broker.ledger import LedgerState
from broker.policies.base import PendingItem
from broker.policies.misa_t import MisaT
from broker.shares import WAITING_FRESH_S, Tenant, is_waiting, parse_tenants, part_for
from broker.snapshot import backend_view

C = 100_000


def test_parse_tenants_named_equal_and_rest() -> None:
    assert parse_tenants("job") == {"job": 1.0}
    assert parse_tenants("a,b") == {"a": 0.5, "b": 0.5}
    assert parse_tenants("a=0.6, b=0.4") == {"a": 0.6, "b": 0.4}
    assert parse_tenants("a=0.5,b,c") == {"a": 0.5, "b": 0.25, "c": 0.25}


@pytest.mark.parametrize("text, says", [
    ("a=0.7,b=0.5", "sum to 1.2"),
    ("a=x", "'x'"),
    ("a=0", "(0, 1]"),
    ("a,a", "named twice"),
    ("a,,b", "empty entry"),
    ("a:b", "'a:b'"),
    ("a=1,b", "leave nothing for b"),
])
def test_parse_tenants_refuses_naming_the_field(text: str, says: str) -> None:
    with pytest.raises(ValueError, match="^namespace: ") as err:
        parse_tenants(text)
    assert says in str(err.value)


def test_idle_peers_lend_everything_they_do_not_hold() -> None:
    # b's 10k reserved at α 2 is a stake of 5k engine tokens, and b waits for nothing.
    tenants = [Tenant("a", 0.5, 20_000, 1.0, True, kv_tokens=10_000),
               Tenant("b", 0.5, 10_000, 2.0, False, kv_tokens=5_000)]
    part = part_for("a", tenants, C, kv_usage=0.15)
    assert part.capacity_tokens == C - 5_000  # a borrows the rest
    # The engine's 15% in use is split by context held: a's 2/3 of 15k, of a's 95k part.
    assert part.kv_usage == pytest.approx(10_000 / 95_000)


def test_a_waiting_peer_keeps_its_guarantee() -> None:
    tenants = [Tenant("a", 0.7, 60_000, 1.0, True), Tenant("b", 0.3, 5_000, 1.0, True)]
    assert part_for("a", tenants, C, 0.0).capacity_tokens == C - 30_000  # b's 30% kept
    assert part_for("b", tenants, C, 0.0).capacity_tokens == C - 70_000  # a's 70% kept
    # a's stake is under its 70k guarantee but it waits: b may not grow into it.
    tenants = [Tenant("a", 0.7, 20_000, 1.0, True), Tenant("b", 0.3, 5_000, 1.0, True)]
    assert part_for("b", tenants, C, 0.0).capacity_tokens == C - 70_000


def test_a_borrower_gives_back_only_as_its_sessions_end() -> None:
    # b borrowed 90% while a was idle (180k reserved at α 2); a now waits: a's part is what
    # b's stake leaves.
    tenants = [Tenant("a", 0.5, 0, 1.0, True), Tenant("b", 0.5, 180_000, 2.0, True)]
    assert part_for("a", tenants, C, 0.9).capacity_tokens == 10_000
    assert part_for("a", tenants, C, 0.9).kv_usage == 0.0
    # ... and b, over its share with a waiting, may not grow at all (its part is under its
    # stake: α·50k = 100k < 180k reserved).
    assert part_for("b", tenants, C, 0.9).capacity_tokens == 50_000


def test_a_namespace_over_its_part_sees_by_how_much() -> None:
    """b holds 90k of the engine's KV (it borrowed while a was idle) against a part of 50k now
    that a waits: its usage reads 1.8 of its part, not a full 1.0, so its α loop sees how far
    over it is."""
    tenants = [Tenant("a", 0.5, 0, 1.0, True, kv_tokens=0),
               Tenant("b", 0.5, 180_000, 2.0, True, kv_tokens=90_000)]
    assert part_for("b", tenants, C, 0.9).kv_usage == pytest.approx(1.8)


def test_a_part_never_reaches_zero_and_foreign_adapters_count() -> None:
    tenants = [Tenant("a", 0.5, 0, 1.0, True, adapters=frozenset({"a/x"})),
               Tenant("b", 0.5, 2 * C, 1.0, False, adapters=frozenset({"b/x", "b/y"}))]
    part = part_for("a", tenants, C, 1.0)
    assert part.capacity_tokens == 1  # nothing fits, and no policy divides by zero
    assert part.foreign_adapters == 2
    with pytest.raises(ValueError, match="namespace: 'c'"):
        part_for("c", tenants, C, 0.0)


def test_waiting_is_what_the_broker_said_lately() -> None:
    assert not is_waiting(None, 100.0)
    assert is_waiting(100.0 - WAITING_FRESH_S, 100.0)
    assert not is_waiting(100.0 - WAITING_FRESH_S - 0.1, 100.0)


def _ledger() -> LedgerState:
    return LedgerState(backend_id="b0", capacity_tokens=C, max_model_len=8192, alpha=1.0,
                       reserved_tokens=0, reserved_by_workload={}, sessions={}, model="m",
                       max_loras=4)


def _beat(part: SharedPart | None) -> HeartbeatRecord:
    return HeartbeatRecord(backend_id="b0", at=1.0, shared=part,
                           metrics=EngineMetrics(kv_usage=0.1, running=0, waiting=0,
                                                 preemptions_total=0, prefix_queries_total=0,
                                                 prefix_hits_total=0))


def test_a_shared_beat_is_the_part_the_policy_plans_against() -> None:
    alone = backend_view(_ledger(), _beat(None), {})
    assert (alone.capacity_tokens, alone.max_loras, alone.shared) == (C, 4, False)
    part = SharedPart(capacity_tokens=30_000, share=0.3, foreign_adapters=3, namespaces=2)
    view = backend_view(_ledger(), _beat(part), {})
    assert (view.capacity_tokens, view.max_loras, view.shared) == (30_000, 1, True)


def test_misa_t_keeps_admission_closed_on_a_shared_engine() -> None:
    """Single-turn work opens MISA-T's admission (the engine queues what does not fit): on a
    shared engine that would let one job fill the queue ahead of the other, so the ledger's
    α stays the loop's there."""
    from broker.policies.base import Snapshot

    items = tuple(PendingItem(session_id=f"s{i}", workload="w", group_id=None, group_size=1,
                              prompt_tokens=1000, prefix=(i,), max_tokens=4000, max_turns=1,
                              turn=0, home_backend=None, enqueued_at=0.0) for i in range(400))
    for part, opened in ((None, True), (SharedPart(capacity_tokens=C, share=0.5,
                                                   namespaces=2), False)):
        policy = MisaT()
        view = backend_view(_ledger(), _beat(part), {})
        decision = policy.decide(Snapshot(now=2.0, pending={"w": items}, backends=(view,),
                                          mixture_target={"w": 1.0}, consumed={}))
        placed = sum(a.reserved_tokens for a in decision.admissions)
        assert policy.alpha_loop.open is True
        assert (placed > 2 * C) is opened, placed


def test_only_a_shared_engines_part_may_read_over_full() -> None:
    over = EngineMetrics(kv_usage=1.4, running=0, waiting=0, preemptions_total=0,
                         prefix_queries_total=0, prefix_hits_total=0)
    with pytest.raises(ValueError, match=r"metrics.kv_usage: 1.4 is above 1 on an engine"):
        HeartbeatRecord(backend_id="b0", at=1.0, metrics=over)
    part = SharedPart(capacity_tokens=50_000, share=0.5, namespaces=2)
    assert HeartbeatRecord(backend_id="b0", at=1.0, metrics=over, shared=part).telemetry() \
        .kv_usage == 1.4
