"""The ledger invariant under concurrent brokers, clients and workers.

Invariant checked at every sample: on each backend reserved ≤ floor(α·C) and reserved equals the
sum of its per-session reservations; at the end every session finished once and reserved is 0.
"""

from __future__ import annotations

import random
import threading

import pytest
import redis

from sim.backend import SimulatedBackend
from broker.client import RolloutClient
from broker.keys import BROKER_GROUP, Keys
from broker.ledger import parse_ledger
from broker.scripts import Scripts
from broker.streams import as_text
from tests.broker.helpers import BrokerThread, make_session, wait_until
from tests.broker.policies_for_tests import OverbookingPolicy

pytestmark = pytest.mark.timeout(120)
CAPACITY = 400


def check_ledgers(client: redis.Redis, k: Keys, backends: list[str]) -> list[str]:
    pipe = client.pipeline(transaction=True)  # MULTI: one consistent view of all ledgers
    for b in backends:
        pipe.hgetall(k.ledger(b))
        pipe.hgetall(k.ledger_sessions(b))
    replies = pipe.execute()
    bad = []
    for i, b in enumerate(backends):
        led = parse_ledger(b, replies[2 * i], replies[2 * i + 1])
        if led.reserved_tokens > led.limit_tokens:
            bad.append(f"{b}: reserved {led.reserved_tokens} > limit {led.limit_tokens}")
        if led.reserved_tokens != sum(led.sessions.values()):
            bad.append(f"{b}: reserved {led.reserved_tokens} != sum {sum(led.sessions.values())}")
        if led.reserved_tokens != sum(led.reserved_by_workload.values()):
            bad.append(f"{b}: per-workload sums disagree")
    return bad


def test_ledger_invariant_with_competing_brokers_clients_and_workers(redis_url, namespace,
                                                                       redis_client):
    k = Keys(namespace)
    names = [f"b{i}" for i in range(4)]
    backends = [SimulatedBackend(redis_url, namespace, b, CAPACITY, service_s=0.01).start()
                for b in names]
    # Three brokers compete for the lease; their policy tries to overbook every backend, so
    # only the admit script stands between it and a broken ledger.
    brokers = [BrokerThread(redis_url, namespace, policy=OverbookingPolicy(), lease_s=0.6).start()
               for _ in range(3)]
    violations: list[str] = []
    done = threading.Event()

    def monitor() -> None:
        mon = redis.Redis.from_url(redis_url)
        while not done.is_set():
            violations.extend(check_ledgers(mon, k, names))
        mon.close()

    def producer(p: int) -> None:
        c = RolloutClient(redis_url, namespace)
        for start in range(0, 300, 50):
            c.enqueue([make_session(i, workload=("rlvr", "rlhf")[i % 2], max_tokens=24 + i % 50,
                                    prefix=f"p{p}-") for i in range(start, start + 50)])
        c.close()

    mon_t = threading.Thread(target=monitor, daemon=True)
    mon_t.start()
    producers = [threading.Thread(target=producer, args=(p,)) for p in range(3)]
    for t in producers:
        t.start()
    for t in producers:
        t.join()
    client = RolloutClient(redis_url, namespace)
    got: list = []
    try:
        # Stop whichever broker is active part-way: another must take over.
        wait_until(lambda: len(got.__iadd__(client.results(300, timeout=0.2)) or got) >= 300, 30, 0)
        for b in brokers[:2]:
            b.stop()
        wait_until(lambda: len(got.__iadd__(client.results(900, timeout=0.2)) or got) >= 900, 60, 0)
        client.ack()
    finally:
        done.set()
        mon_t.join()
        brokers[2].stop()
        for b in backends:
            b.stop()
        client.close()
    assert violations == []
    ids = [r.session_id for r in got]
    assert len(ids) == 900 and len(set(ids)) == 900
    assert check_ledgers(redis_client, k, names) == []
    assert all(parse_ledger(b, redis_client.hgetall(k.ledger(b)), {}).reserved_tokens == 0
               for b in names)
    # each session published once: 900 finishes counted, and none left in the stream (an
    # acknowledged result leaves it; a second one would still be there)
    counts = redis_client.hgetall(k.kv_seconds)
    assert int(counts[b"n:rlvr"]) + int(counts[b"n:rlhf"]) == 900
    assert redis_client.xlen(k.results) == 0


def test_admit_script_is_atomic_under_racing_callers(redis_url, namespace, redis_client):
    """Eight threads race the admit script over the same sessions and backends directly."""
    k = Keys(namespace)
    client = RolloutClient(redis_url, namespace)
    for b in ("x0", "x1"):
        from broker.worker_link import WorkerLink
        from broker.heartbeat import EngineMetrics
        link = WorkerLink(redis_url, namespace, b, heartbeat_ttl_s=60)
        link.register(1000, 4096)
        link.heartbeat(EngineMetrics(kv_usage=0, running=0, waiting=0, preemptions_total=0,
                                     prefix_queries_total=0, prefix_hits_total=0))
    client.enqueue([make_session(i) for i in range(400)])
    redis_client.xgroup_create(k.pending("rlvr"), BROKER_GROUP, id="0")
    entries = redis_client.xreadgroup(BROKER_GROUP, "c", {k.pending("rlvr"): ">"}, count=1000)[0][1]
    redis_client.set(k.lease, "T")
    outcomes: list[str] = []

    def racer(seed: int) -> None:
        r = redis.Redis.from_url(redis_url)
        s = Scripts(r)
        rng = random.Random(seed)
        order = entries[:]
        rng.shuffle(order)
        for eid, f in order:
            sid, b = f[b"sid"].decode(), rng.choice(["x0", "x1"])
            outcomes.append(as_text(s.admit(
                keys=[k.lease, k.session(sid), k.ledger(b), k.ledger_sessions(b),
                      k.heartbeat(b), k.admitted(b), k.pending("rlvr")],
                args=["T", sid, b, rng.randint(1, 20), eid, "1.0", "1"])))
        r.close()

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client.close()
    assert check_ledgers(redis_client, k, ["x0", "x1"]) == []
    placed = sum(len(redis_client.hkeys(k.ledger_sessions(b))) for b in ("x0", "x1"))
    assert outcomes.count("ok") == placed  # each session placed at most once
    assert redis_client.xlen(k.admitted("x0")) + redis_client.xlen(k.admitted("x1")) == placed
