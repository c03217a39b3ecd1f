"""The staleness bound: a session too far behind the policy version the engines serve is not
admitted (or runs on current weights, by its own choice), and an old result is never handed
over as fresh. Real Redis, a broker thread and a simulated backend."""

from __future__ import annotations

import pytest

from sim.backend import SimulatedBackend
from broker.client import RolloutClient
from broker.keys import Keys
from broker.session import Session, SessionState
from tests.broker.helpers import BrokerThread, wait_until

pytestmark = pytest.mark.timeout(60)


def session(sid: str, version: int, on_stale: str = "fail") -> Session:
    return Session(session_id=sid, workload="rlvr", prompt_token_ids=[1, 2, 3], max_tokens=8,
                   policy_version=version, on_stale=on_stale)


def test_stale_sessions_are_not_admitted_and_old_results_are_flagged(redis_url, namespace,
                                                                    redis_client):
    client = RolloutClient(redis_url, namespace)
    client.resume(5)  # the engines serve version 5
    client.set_max_staleness(1)
    assert client.weights().max_staleness == 1
    client.enqueue([session("old", 3), session("old-refresh", 3, "refresh"),
                    session("v4", 4), session("v5", 5)])
    backend = SimulatedBackend(redis_url, namespace, "b0", capacity_tokens=10_000).start()
    broker = BrokerThread(redis_url, namespace).start()
    got = []
    try:
        assert wait_until(lambda: len(got.__iadd__(client.results(4, timeout=0.2)) or got) >= 4,
                          timeout=30, every=0)
    finally:
        broker.stop()
        backend.stop()
    by_id = {r.session_id: r for r in got}
    old = by_id["old"]
    assert old.status == SessionState.failed and old.error.startswith("stale: ")
    assert "policy version 3, the engines serve 5 and max_staleness is 1" in old.error
    never = redis_client.hget(Keys(namespace).session("old"), "admitted_at")
    assert never is None  # it never reached a backend
    assert [by_id[s].status for s in ("old-refresh", "v4", "v5")] == [SessionState.done] * 3
    # Handed over: what is more than one version behind 5 is flagged, the rest is fresh.
    assert {s: by_id[s].stale for s in by_id} == {"old": True, "old-refresh": True,
                                                  "v4": False, "v5": False}
    client.set_max_staleness(None)
    assert client.weights().max_staleness is None
    client.close()


def test_a_bad_bound_is_refused_naming_the_field(redis_url, namespace):
    with RolloutClient(redis_url, namespace) as client:
        for bad in (-1, 1.5, True):
            with pytest.raises(ValueError, match="max_staleness: must be a non-negative"):
                client.set_max_staleness(bad)


def test_sessions_already_waiting_expire_when_the_version_moves_past_the_bound(redis_url,
                                                                              namespace):
    client = RolloutClient(redis_url, namespace)
    client.resume(5)
    client.set_max_staleness(1)
    client.enqueue([session("w0", 5), session("w1", 4)])  # fresh now; no backend to run them
    broker = BrokerThread(redis_url, namespace).start()
    try:
        assert client.results(2, timeout=0.5) == []  # held by the broker, not stale yet
        client.resume(7)  # the engines move on: both are now more than 1 behind
        got = []
        assert wait_until(lambda: len(got.__iadd__(client.results(2, timeout=0.2)) or got) >= 2,
                          timeout=20, every=0)
    finally:
        broker.stop()
        client.close()
    assert sorted(r.session_id for r in got) == ["w0", "w1"]
    assert all(r.status == SessionState.failed and r.error.startswith("stale: ") for r in got)
