"""The broker loop end to end: real Redis, broker threads, simulated backends, the client."""

from __future__ import annotations

import time

import pytest

from sim.backend import SimulatedBackend
from broker.client import RolloutClient
from broker.heartbeat import EngineMetrics
from broker.ledger import Ledger
from broker.keys import Keys
from broker.worker_link import WorkerLink
from tests.broker.helpers import BrokerThread, make_session, published, wait_until

pytestmark = pytest.mark.timeout(90)


def collect(client: RolloutClient, n: int, timeout: float = 30.0) -> list:
    got = []
    wait_until(lambda: got.extend(client.results(n - len(got), timeout=0.5)) or len(got) >= n,
               timeout=timeout, every=0)
    client.ack()
    return got


@pytest.fixture
def fleet(redis_url, namespace, redis_client):
    started: list = []

    def start(backend_id: str, capacity: int = 2000, **kw) -> SimulatedBackend:
        b = SimulatedBackend(redis_url, namespace, backend_id, capacity, **kw).start()
        started.append(b)
        return b
    yield start
    for b in started:
        b.stop()


def test_sessions_flow_to_results_exactly_once(redis_url, namespace, fleet, redis_client):
    fleet("b0")
    fleet("b1")
    broker = BrokerThread(redis_url, namespace).start()
    client = RolloutClient(redis_url, namespace)
    try:
        sessions = [make_session(i, workload=("rlvr", "rlhf")[i % 2]) for i in range(300)]
        assert len(client.enqueue(sessions)) == 300
        got = collect(client, 300)
        assert sorted(r.session_id for r in got) == sorted(s.session_id for s in sessions)
        assert {r.backend_id for r in got} == {"b0", "b1"}
        assert client.results(10, timeout=0.3) == []  # nothing twice
        st = client.status()
        assert st["consumed"] == {"rlvr": 150, "rlhf": 150}
        assert all(b["reserved_tokens"] == 0 and b["sessions"] == 0 for b in st["backends"].values())
        assert st["pending"] == {"rlvr": 0, "rlhf": 0, "agentic": 0}
    finally:
        broker.stop()
        client.close()


def test_malformed_entry_is_dead_lettered_and_the_broker_goes_on(redis_url, namespace, fleet,
                                                                  redis_client):
    fleet("b0")
    k = Keys(namespace)
    client = RolloutClient(redis_url, namespace)
    redis_client.xadd(k.pending("rlvr"), {"sid": "bad1", "session": "{not json"})
    redis_client.xadd(k.pending("rlvr"), {"hello": "world"})
    broker = BrokerThread(redis_url, namespace).start()
    try:
        client.enqueue([make_session(1)])
        got = collect(client, 1)
        assert [r.session_id for r in got] == ["s1"]
        dead = redis_client.xrange(k.dead_letter)
        reasons = sorted(f[b"reason"].decode() for _, f in dead)
        assert len(dead) == 2
        assert any("does not validate" in r for r in reasons)
        assert any("no 'sid'" in r for r in reasons)
        assert redis_client.xlen(k.pending("rlvr")) == 0
    finally:
        broker.stop()
        client.close()


def test_backend_that_stops_heartbeating_gets_its_sessions_requeued(redis_url, namespace, fleet,
                                                                     redis_client):
    dying = fleet("b0", hold=True, heartbeat_ttl_s=0.6, heartbeat_s=0.1)
    broker = BrokerThread(redis_url, namespace).start()
    client = RolloutClient(redis_url, namespace)
    ledger = Ledger(redis_client, Keys(namespace))
    try:
        client.enqueue([make_session(i) for i in range(20)])
        assert wait_until(lambda: len(ledger.read("b0").sessions) == 20)
        fleet("b1")
        dying.stop_heartbeats()
        got = collect(client, 20)
        assert sorted(r.session_id for r in got) == sorted(f"s{i}" for i in range(20))
        assert {r.backend_id for r in got} == {"b1"}
        assert ledger.read("b0").reserved_tokens == 0
        assert published(redis_client, Keys(namespace)) == 20
    finally:
        broker.stop()
        client.close()


def test_new_completions_reach_the_policy(redis_url, namespace, fleet):
    fleet("b0")
    broker = BrokerThread(redis_url, namespace).start()
    client = RolloutClient(redis_url, namespace)
    try:
        client.enqueue([make_session(i) for i in range(10)])
        collect(client, 10)
        assert wait_until(lambda: broker.service.policy.seen_completions == 10, timeout=10)
    finally:
        broker.stop()
        client.close()


def test_a_new_broker_recalls_what_the_namespace_learned_and_each_completion_once(
        redis_url, namespace, fleet):
    fleet("b0")
    client = RolloutClient(redis_url, namespace)
    first = BrokerThread(redis_url, namespace).start()
    try:
        client.enqueue([make_session(i) for i in range(10)])
        collect(client, 10)
    finally:
        first.stop()
    # A new run's broker (a restart, a standby): the ten completions before its first decide.
    second = BrokerThread(redis_url, namespace).start()
    try:
        assert wait_until(lambda: second.service.lease.held, timeout=10)
        assert sorted(second.service.policy.recalled) == sorted(f"s{i}" for i in range(10))
        client.enqueue([make_session(i) for i in range(10, 15)])
        collect(client, 5)
        assert wait_until(lambda: second.service.policy.seen_completions == 5, timeout=10)
    finally:
        second.stop()
        client.close()
    # Taking the lease again (after losing it), it recalls only what it has not learned.
    second.service._take_over()
    assert len(second.service.policy.recalled) == 10


def test_a_session_cancelled_while_admitted_is_forgotten_by_the_broker(redis_url, namespace):
    link = WorkerLink(redis_url, namespace, "idle", heartbeat_ttl_s=30.0)
    link.register(100_000, 4096)  # admits, never runs anything
    beat = EngineMetrics(kv_usage=0.0, running=0, waiting=0, preemptions_total=0,
                         prefix_queries_total=0, prefix_hits_total=0)
    link.heartbeat(beat)
    broker = BrokerThread(redis_url, namespace).start()
    client = RolloutClient(redis_url, namespace)
    try:
        client.enqueue([make_session(1)])
        # Read it each time: the broker replaces the dict when it takes the lease, which
        # may come after this line (a reference taken here missed the admission in a CI run).
        assert wait_until(lambda: "s1" in broker.service._meta, timeout=10)
        assert client.cancel("s1") == "cancelled"
        link.heartbeat(beat)  # any event: the broker looks again
        assert wait_until(lambda: "s1" not in broker.service._meta, timeout=10)
    finally:
        broker.stop()
        client.close()
        link.close()


def test_a_dead_lettered_session_says_so(redis_url, namespace, fleet, redis_client):
    fleet("b0")
    k = Keys(namespace)
    client = RolloutClient(redis_url, namespace)
    client.enqueue([make_session(1)])
    # Its queue entry is damaged after enqueue (a bad writer, a restored backup): the broker
    # cannot read it, so it goes to the dead letters, and the session must not stay 'pending'.
    [(eid, fields)] = redis_client.xrange(k.pending("rlvr"))
    redis_client.xdel(k.pending("rlvr"), eid)
    new_id = redis_client.xadd(k.pending("rlvr"), {"sid": "s1", "session": b"{broken"})
    redis_client.hset(k.session("s1"), "pending_entry", new_id)
    broker = BrokerThread(redis_url, namespace).start()
    try:
        assert wait_until(lambda: redis_client.hget(k.session("s1"), "state") == b"dead_lettered")
        assert redis_client.hget(k.session("s1"), "last_error").startswith(b"session JSON does")
        assert client.cancel("s1") == "dead_lettered"  # too late, and it says why
        [(_, dead)] = redis_client.xrange(k.dead_letter)
        assert dead[b"f:sid"] == b"s1" and dead[b"entry_id"] == new_id
    finally:
        broker.stop()
        client.close()


def test_a_running_session_its_worker_lost_is_requeued(redis_url, namespace, fleet, redis_client):
    """A live backend that stops listing a running session in its beats (its worker dropped
    it: a bug, a lost write) does not keep it, or its KV, forever."""
    forgetful = fleet("b0", hold=True, heartbeat_s=0.1)
    broker = BrokerThread(redis_url, namespace, orphan_after_s=1.0, orphan_check_s=0.2).start()
    client = RolloutClient(redis_url, namespace)
    ledger = Ledger(redis_client, Keys(namespace))
    try:
        client.enqueue([make_session(i) for i in range(3)])
        assert wait_until(lambda: len(forgetful._running) == 3)
        forgetful._running.pop("s1")  # the worker forgets it; its beats stop listing it
        assert wait_until(lambda: redis_client.hget(Keys(namespace).session("s1"),
                                                    "requeued_from") == b"b0", timeout=20)
        assert redis_client.hget(Keys(namespace).session("s1"), "attempts") == b"1"
        assert wait_until(lambda: "s1" in forgetful._running)  # admitted again, here
        assert set(ledger.read("b0").sessions) == {"s0", "s1", "s2"}
        assert redis_client.xlen(Keys(namespace).results) == 0  # nothing published twice
    finally:
        broker.stop()
        client.close()


def test_recharges_reach_the_ledger_for_sessions_admitted_here_and_by_an_earlier_broker(
        redis_url, namespace, fleet, redis_client):
    """The broker plans a decision on copies of the ledgers it touches only; a recharged
    session's ledger must be among them whether this broker admitted it (it remembers where)
    or a broker before it did (it looks the session up)."""
    from tests.broker.policies_for_tests import RechargingPolicy

    fleet("b0", hold=True, heartbeat_s=0.1)
    fleet("b1", hold=True, heartbeat_s=0.1)
    client = RolloutClient(redis_url, namespace)
    ledger = Ledger(redis_client, Keys(namespace))

    def charges() -> set[int]:
        return {t for b in ("b0", "b1") for t in ledger.read(b).sessions.values()}

    try:
        first = BrokerThread(redis_url, namespace, RechargingPolicy(20)).start()
        # One that does not fit beside the others (1,998 of a 2,000-token cache) keeps work
        # pending, so the broker keeps deciding.
        client.enqueue([make_session(i) for i in range(6)]
                       + [make_session(0, max_tokens=1990, prefix="big")])
        assert wait_until(lambda: sum(len(ledger.read(b).sessions) for b in ("b0", "b1")) == 6)
        assert wait_until(lambda: charges() == {20})
        first.stop()
        second = BrokerThread(redis_url, namespace, RechargingPolicy(21)).start()
        try:
            assert wait_until(lambda: charges() == {21})
        finally:
            second.stop()
    finally:
        client.close()


def test_a_heartbeat_missing_only_since_the_broker_started_watching_is_given_time(
        redis_url, namespace, redis_client):
    """After a Redis restart every heartbeat key may have expired during the outage: the
    broker waits `reap_grace_s` of its own watching before it calls a backend dead."""
    link = WorkerLink(redis_url, namespace, "b0", heartbeat_ttl_s=30.0)
    link.register(100_000, 4096)
    beat = EngineMetrics(kv_usage=0.0, running=0, waiting=0, preemptions_total=0,
                         prefix_queries_total=0, prefix_hits_total=0)
    link.heartbeat(beat)
    k = Keys(namespace)
    client = RolloutClient(redis_url, namespace)
    first = BrokerThread(redis_url, namespace).start()
    try:
        client.enqueue([make_session(1)])
        assert wait_until(lambda: redis_client.hget(k.session("s1"), "state") == b"admitted")
    finally:
        first.stop()
    redis_client.delete(k.heartbeat("b0"))  # expired while "Redis was down"
    broker = BrokerThread(redis_url, namespace, reap_grace_s=2.0).start()
    try:
        time.sleep(0.5)
        link.heartbeat(beat)  # the worker is back within the grace
        time.sleep(2.5)
        link.heartbeat(beat)
        assert redis_client.hget(k.session("s1"), "state") == b"admitted"
        assert redis_client.hget(k.session("s1"), "requeued_at") is None  # never taken back
        redis_client.delete(k.heartbeat("b0"))  # now it really is gone
        assert wait_until(lambda: redis_client.hget(k.session("s1"), "state") == b"pending",
                          timeout=20)
    finally:
        broker.stop()
        client.close()
        link.close()
