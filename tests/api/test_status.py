"""GET /v1/status and /v1/backends against real Redis, a broker thread and simulated backends."""

from __future__ import annotations

import time

import pytest

from api.history import CounterHistory, Sample
from api.status import drift
from broker import latency
from broker.client import RolloutClient
from broker.keys import Keys
from tests.api.helpers import session_json
from tests.broker.helpers import wait_until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


def test_queue_depth_and_oldest_age_before_any_broker(api):
    batch = [session_json(i, workload=("rlvr", "agentic")[i % 3 == 0]) for i in range(30)]
    assert api.post("/v1/sessions", json={"sessions": batch}).status_code == 200
    time.sleep(0.05)
    st = api.get("/v1/status").json()
    depth = {w["workload"]: w["depth"] for w in st["workloads"]}
    assert depth == {"agentic": 10, "rlhf": 0, "rlvr": 20}
    ages = {w["workload"]: w["oldest_pending_age_s"] for w in st["workloads"]}
    assert ages["rlhf"] is None
    assert 0.04 <= ages["rlvr"] < 30 and 0.04 <= ages["agentic"] < 30
    assert st["broker"] == {"lease_held": False, "policy": None, "holder": None}
    assert st["backends"] == []


def test_backends_show_reservations_heartbeats_and_admissions(api, fleet):
    fleet.backend("b0", capacity=5000, hold=True)
    fleet.backend("b1", capacity=3000, hold=True)
    fleet.start_broker("least_loaded")
    batch = [session_json(i, workload=("rlvr", "rlhf")[i % 2]) for i in range(20)]
    assert api.post("/v1/sessions", json={"sessions": batch}).status_code == 200

    def settled() -> bool:
        st = api.get("/v1/status").json()
        return (sum(b["sessions"] for b in st["backends"]) == 20
                and sum(b["running"] or 0 for b in st["backends"]) == 20)
    assert wait_until(settled, timeout=20)
    st = api.get("/v1/status").json()
    assert st["broker"]["lease_held"] is True
    assert st["broker"]["policy"] == "least_loaded" and st["broker"]["holder"].startswith("broker-")
    assert all(w["depth"] == 0 for w in st["workloads"])
    by_id = {b["backend_id"]: b for b in st["backends"]}
    assert set(by_id) == {"b0", "b1"}
    b0 = by_id["b0"]
    assert b0["capacity_tokens"] == 5000 and by_id["b1"]["capacity_tokens"] == 3000
    assert b0["healthy"] and b0["alpha"] == 1.0 and b0["limit_tokens"] == 5000
    assert b0["heartbeat_age_s"] is not None and b0["heartbeat_age_s"] < 5
    assert b0["kv_usage"] == 0.0 and b0["waiting"] == 0 and b0["preemptions_total"] == 0
    total_reserved = sum(b["reserved_tokens"] for b in st["backends"])
    assert total_reserved > 0
    assert total_reserved == sum(v for b in st["backends"] for v in b["reserved_by_workload"].values())
    assert sum(b["admitted_total"] for b in st["backends"]) == 20
    assert sorted(api.get("/v1/backends").json(), key=lambda b: b["backend_id"])[0]["backend_id"] == "b0"


def test_dead_backend_turns_unhealthy(api, fleet):
    b = fleet.backend("b0", heartbeat_ttl_s=0.5)
    assert wait_until(lambda: api.get("/v1/backends").json()[0]["healthy"], timeout=5)
    b.stop_heartbeats()
    assert wait_until(lambda: not api.get("/v1/backends").json()[0]["healthy"], timeout=10)
    gone = api.get("/v1/backends").json()[0]
    assert gone["kv_usage"] is None and gone["heartbeat_age_s"] is None


def test_throughput_consumed_window_and_drift(api, fleet, redis_url, namespace, redis_client):
    fleet.backend("b0")
    fleet.start_broker("least_loaded")
    trainer = RolloutClient(redis_url, namespace)
    try:
        assert api.put("/v1/mixture", json={"shares": {"rlvr": 0.5, "rlhf": 0.5}}).status_code == 200
        first = api.get("/v1/status").json()
        assert first["mixture"]["drift_total"] is None  # nothing consumed yet
        batch = [session_json(i, workload="rlvr" if i < 30 else "rlhf") for i in range(40)]
        api.post("/v1/sessions", json={"sessions": batch})
        got: list = []
        assert wait_until(lambda: got.extend(trainer.results(40 - len(got), timeout=0.2))
                          or len(got) >= 40, timeout=20, every=0)
        trainer.ack()
        time.sleep(0.3)  # history keeps one sample per 0.25 s
        st = api.get("/v1/status").json()
    finally:
        trainer.close()
    mix = st["mixture"]
    assert mix["consumed_total"] == {"rlvr": 30, "rlhf": 10}
    assert mix["consumed_window"] == {"rlvr": 30, "rlhf": 10}
    assert mix["drift_total"] == pytest.approx(0.25)
    assert mix["drift_window"] == pytest.approx(0.25)
    one_min = st["throughput"][0]
    assert one_min["window_s"] == 60 and one_min["covered_s"] > 0.25
    assert one_min["sessions_per_s"] == pytest.approx(40 / one_min["covered_s"])
    assert {w["workload"]: w["finished_total"] for w in st["workloads"]}["rlvr"] == 30
    tokens = sum(r.output_tokens for r in got)
    assert tokens > 0 and one_min["tokens_per_s"] == pytest.approx(tokens / one_min["covered_s"])
    assert sum(one_min["tokens_by_workload"].values()) == pytest.approx(one_min["tokens_per_s"])
    assert {w["workload"]: w["failed_total"] for w in st["workloads"]} == {
        w["workload"]: sum(r.workload == w["workload"] and r.status == "failed" for r in got)
        for w in st["workloads"]}
    # Latency quantiles of the window: within a √2-wide bucket of the results' own.
    lat = {w["workload"]: w["latency"] for w in st["workloads"]}
    assert lat["agentic"] is None  # nothing finished
    for w, n in (("rlvr", 30), ("rlhf", 10)):
        own = sorted(float(redis_client.hget(Keys(namespace).session(r.session_id), "finished_at"))
                     - float(redis_client.hget(Keys(namespace).session(r.session_id), "enqueued_at"))
                     for r in got if r.workload == w)
        assert lat[w]["finished"] == n and lat[w]["window_s"] == mix["window_s"]
        bucket = latency.bucket_of(own[(n - 1) // 2])  # the median's
        # (the smallest bucket holds everything from 0 up: a quick machine's median is there)
        low = 0.0 if bucket <= latency.MIN_BUCKET else latency.upper_bound_s(bucket - 1)
        assert low <= lat[w]["p50_s"] <= latency.upper_bound_s(bucket)
        top = latency.upper_bound_s(latency.bucket_of(own[-1]))
        assert lat[w]["p50_s"] <= lat[w]["p95_s"] <= lat[w]["p99_s"] <= top


def test_drift_formula():
    assert drift({}, {"a": 1.0}) is None
    assert drift({"a": 5}, {}) is None
    assert drift({"a": 1, "b": 1}, {"a": 0.5, "b": 0.5}) == 0.0
    assert drift({"a": 3}, {"a": 0.5, "b": 0.5}) == pytest.approx(0.5)


def test_history_windows_and_reset():
    h = CounterHistory(keep_s=100)
    for t in range(0, 101, 10):
        h.add(Sample(at=float(t), finished={"a": t}, consumed={"a": t // 2}))
    now = Sample(at=105.0, finished={"a": 105}, consumed={"a": 52})
    d = h.delta(now, 30)
    assert d.span_s == 25.0 and d.finished == {"a": 25}  # oldest sample inside: t=80
    assert h.delta(now, 1000).span_s == 105.0  # only what is kept
    reset = Sample(at=106.0, finished={"a": 3}, consumed={})
    assert h.delta(reset, 30).finished == {"a": 3}


def test_the_api_keeps_the_charts_history(api, fleet):
    fleet.backend("b0")
    api.post("/v1/sessions", json={"sessions": [session_json(i) for i in range(3)]})
    api.get("/v1/status")
    time.sleep(1.1)  # the trail keeps one sample a second
    api.get("/v1/status")
    h = api.get("/v1/history").json()
    assert len(h["samples"]) >= 2 and h["now"] >= h["samples"][-1]["at"]
    last = h["samples"][-1]
    assert last["queue"]["rlvr"] == 3 and "b0" in last["kv"]
    assert [s["at"] for s in h["samples"]] == sorted(s["at"] for s in h["samples"])


def test_a_shared_engine_shows_this_namespaces_share_and_part(api, redis_url, namespace):
    """A backend whose engine other namespaces share (docs/fleet.md): its status and metrics
    say this namespace's guaranteed share and the part it plans against now."""
    from broker.heartbeat import EngineMetrics, SharedPart
    from broker.worker_link import WorkerLink

    metrics = EngineMetrics(kv_usage=0.2, running=1, waiting=0, preemptions_total=0,
                            prefix_queries_total=0, prefix_hits_total=0)
    links = {b: WorkerLink(redis_url, namespace, b) for b in ("shared", "own")}
    try:
        for link in links.values():
            link.register(10_000, 4096)
        links["shared"].heartbeat(metrics, shared=SharedPart(capacity_tokens=3_000, share=0.3,
                                                             namespaces=2))
        links["own"].heartbeat(metrics)
        by_id = {b["backend_id"]: b for b in api.get("/v1/backends").json()}
        assert (by_id["shared"]["share"], by_id["shared"]["part_tokens"]) == (0.3, 3_000)
        assert (by_id["own"]["share"], by_id["own"]["part_tokens"]) == (None, None)
        text = api.get("/metrics").text
        assert 'rb_backend_part_tokens{backend="shared"} 3000.0' in text
        assert 'rb_backend_share_ratio{backend="shared"} 0.3' in text
        assert 'rb_backend_share_ratio{backend="own"}' not in text
    finally:
        for link in links.values():
            link.close()
