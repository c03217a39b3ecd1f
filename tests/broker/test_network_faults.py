"""Network faults between a backend and Redis (sim/netfault.py), not process faults: a backend
whose link stops answering without closing for longer than its heartbeat lives is reclaimed,
its sessions run elsewhere, and what it finishes after the link heals is refused as stale.
Exactly once, and results flow again at once. Real Redis, a broker thread and simulated
backends; the whole system under each network fault is `benchmarks/chaos.py`'s `net-*` rows."""

from __future__ import annotations

import time

import pytest

from broker.client import RolloutClient
from broker.keys import Keys
from sim.backend import SimulatedBackend
from sim.netfault import FaultProxy
from tests.broker.helpers import BrokerThread, collect, make_session, published, wait_until

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("fault", ["blackhole", "reset"])
def test_a_backend_cut_off_from_redis_loses_and_duplicates_nothing(redis_url, namespace,
                                                                   redis_client, fault):
    host, port = redis_url.split("//")[1].split("/")[0].rsplit(":", 1)
    proxy = FaultProxy(host, int(port))
    cut = SimulatedBackend(f"redis://127.0.0.1:{proxy.port}/0", namespace, "cut",
                           capacity_tokens=2_000, service_s=1.0, heartbeat_s=0.1,
                           heartbeat_ttl_s=1.0).start()
    other = SimulatedBackend(redis_url, namespace, "other", capacity_tokens=2_000,
                             service_s=0.2).start()
    broker = BrokerThread(redis_url, namespace).start()
    client = RolloutClient(redis_url, namespace)
    got: list = []
    try:
        client.enqueue([make_session(i) for i in range(60)])
        assert wait_until(lambda: redis_client.hlen(Keys(namespace).ledger_sessions("cut")) > 0)
        if fault == "blackhole":  # 3 s of silence: past the 1 s heartbeat TTL
            proxy.blackhole(True)
            time.sleep(3.0)
            proxy.blackhole(False)
        else:  # its connections reset, again and again, for 3 s
            for _ in range(15):
                proxy.reset()
                time.sleep(0.2)
        healed = time.monotonic()
        assert wait_until(lambda: len(got.__iadd__(client.results(64, timeout=0.2)) or got) >= 1,
                          timeout=5, every=0), "no result within 5 s of the fault's end"
        assert time.monotonic() - healed < 5.0
        assert wait_until(lambda: len(got.__iadd__(client.results(64, timeout=0.2)) or got) >= 60,
                          timeout=60, every=0), f"{len(got)} of 60 results"
        time.sleep(1.5)  # anything late would show now
        got += client.results(64, timeout=0.2)
    finally:
        broker.stop()
        cut.stop()
        other.stop()
        client.close()
        proxy.close()
    ids = [r.session_id for r in got]
    assert sorted(ids) == sorted(f"s{i}" for i in range(60))  # each once, none lost
    assert published(redis_client, Keys(namespace)) == 60
    assert redis_client.xlen(Keys(namespace).results) == 0  # all acknowledged: none published twice
    assert all(r.status.value == "done" for r in got)


@pytest.mark.parametrize("reader", ["worker", "broker", "trainer"])
def test_a_read_whose_reply_is_lost_leaves_nothing_it_delivered_unseen(redis_url, namespace,
                                                                       redis_client, reader):
    """Each consumer-group reader (a worker its admitted sessions, the broker the queues, the
    trainer its results) loses the reply of the read that delivers them: Redis ran it, the
    connection was reset on the way back. Sent again, that read would deliver only what came
    next, and these would wait in the reader's pending list for good; instead the reader
    reads its pending list again. Every session ends once."""
    host, port = redis_url.split("//")[1].split("/")[0].rsplit(":", 1)
    proxy = FaultProxy(host, int(port))
    via = {r: f"redis://127.0.0.1:{proxy.port}/0" if r == reader else redis_url
           for r in ("worker", "broker", "trainer")}
    backend = SimulatedBackend(via["worker"], namespace, "b0", capacity_tokens=100_000).start()
    broker = BrokerThread(via["broker"], namespace).start()
    client = RolloutClient(via["trainer"], namespace)
    sessions = [make_session(i, prefix="lostreply-") for i in range(8)]
    try:
        assert wait_until(lambda: client.status()["backends"].get("b0", {}).get("healthy"))
        if reader != "trainer":
            proxy.lose_reply(containing=b"lostreply-")
        client.enqueue(sessions)
        if reader == "trainer":  # (its enqueue goes through the proxy too)
            assert wait_until(lambda: redis_client.xlen(Keys(namespace).results) == 8)
            proxy.lose_reply(containing=b"lostreply-")
        got = collect(client, 8, timeout=30)
        time.sleep(0.5)  # anything late would show now
        got += client.results(8, timeout=0.2)
        assert proxy.lost_replies == 1
    finally:
        broker.stop()
        backend.stop()
        client.close()
        proxy.close()
    assert sorted(r.session_id for r in got) == sorted(s.session_id for s in sessions)
    assert all(r.status.value == "done" for r in got)
