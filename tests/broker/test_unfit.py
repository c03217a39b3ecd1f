"""A session no live backend can hold never blocks its workload (issue 46, finding 1: under
MISA-T one asking max_tokens 20,000 of backends with max_model_len 11,984 stayed pending and
the five sessions enqueued after it in its workload never ran). Refused at enqueue when the
fleet is known; ended failed, naming the limit, when it reaches the broker first. Real Redis,
a broker thread and simulated backends."""

from __future__ import annotations

import pytest

from broker.client import RolloutClient
from broker.keys import Keys
from broker.policies import make_policy
from broker.session import Session, SessionState
from sim.backend import SimulatedBackend
from tests.broker.helpers import BrokerThread, wait_until

pytestmark = pytest.mark.timeout(60)

MAX_MODEL_LEN = 11_984


def session(sid: str, max_tokens: int, prompt: int = 50) -> Session:
    return Session(session_id=sid, workload="rlvr", prompt_token_ids=[1] * prompt,
                   max_tokens=max_tokens)


def results(client: RolloutClient, n: int) -> dict[str, object]:
    got: list = []
    assert wait_until(lambda: len(got.__iadd__(client.results(n, timeout=0.2)) or got) >= n,
                      timeout=30, every=0), f"{len(got)} of {n} results"
    return {r.session_id: r for r in got}


@pytest.mark.parametrize("policy", ["misa_t", "least_loaded", "cache_aware"])
def test_an_oversized_session_fails_at_the_head_and_the_rest_of_its_queue_runs(
        redis_url, namespace, policy):
    client = RolloutClient(redis_url, namespace)
    # Enqueued before any backend registered: nothing to judge it against yet.
    client.enqueue([session("huge", 20_000)] + [session(f"s{i}", 100) for i in range(5)])
    backends = [SimulatedBackend(redis_url, namespace, f"b{i}", capacity_tokens=MAX_MODEL_LEN,
                                 max_model_len=MAX_MODEL_LEN).start() for i in range(2)]
    broker = BrokerThread(redis_url, namespace, policy=make_policy(policy)).start()
    try:
        by_id = results(client, 6)
    finally:
        broker.stop()
        for b in backends:
            b.stop()
        client.close()
    huge = by_id["huge"]
    assert huge.status == SessionState.failed
    assert huge.error.startswith("max_tokens: ") and f"max_model_len is {MAX_MODEL_LEN}" in huge.error
    assert [by_id[f"s{i}"].status for i in range(5)] == [SessionState.done] * 5


def test_with_the_fleet_known_enqueue_refuses_it_naming_the_limit(redis_url, namespace):
    backend = SimulatedBackend(redis_url, namespace, "b0", capacity_tokens=8_000,
                               max_model_len=MAX_MODEL_LEN).start()
    try:
        with RolloutClient(redis_url, namespace) as client:
            with pytest.raises(ValueError, match=r"sessions\[1\]\.max_tokens: .* 20050 tokens of "
                                                 r"context; .*largest max_model_len is 11984"):
                client.enqueue([session("ok", 100), session("huge", 20_000)])
            # Within the context, but more KV than any backend's cache holds.
            with pytest.raises(ValueError, match=r"sessions\[0\]\.max_tokens: .* 9050 tokens "
                                                 r"of KV cache; .*largest holds 8000"):
                client.enqueue([session("big", 9_000)])
            assert client.enqueue([session("ok", 100)]) == ["ok"]
    finally:
        backend.stop()


def test_a_waiting_session_fails_when_the_fleet_shrinks_below_it(redis_url, namespace,
                                                                redis_client):
    client = RolloutClient(redis_url, namespace)
    big = SimulatedBackend(redis_url, namespace, "big", capacity_tokens=8_000,
                           max_model_len=30_000, heartbeat_ttl_s=1.0).start()
    small = SimulatedBackend(redis_url, namespace, "small", capacity_tokens=8_000,
                             max_model_len=2_000).start()
    client.enqueue([session("long", 4_000), session("short", 100)])  # fits "big"
    big.stop()  # ... which dies: registered still, its heartbeat expires
    assert wait_until(lambda: not redis_client.exists(Keys(namespace).heartbeat("big")),
                      timeout=10)
    broker = BrokerThread(redis_url, namespace, policy=make_policy("misa_t")).start()
    try:
        by_id = results(client, 2)
    finally:
        broker.stop()
        small.stop()
        client.close()
    assert by_id["long"].status == SessionState.failed
    assert "largest max_model_len is 2000" in by_id["long"].error
    assert by_id["short"].status == SessionState.done
