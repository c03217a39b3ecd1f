"""GET /metrics: Prometheus text from a per-request registry."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api.helpers import session_json
from tests.broker.helpers import wait_until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_cover_queues_mixture_and_ledger(api, fleet):
    api.put("/v1/mixture", json={"shares": {"rlvr": 0.75, "rlhf": 0.25}})
    api.post("/v1/sessions", json={"sessions": [session_json(i) for i in range(5)]})
    r = api.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = samples(r.text)
    assert m[("rb_queue_depth", (("workload", "rlvr"),))] == 5
    assert m[("rb_oldest_pending_age_seconds", (("workload", "rlvr"),))] >= 0
    assert m[("rb_mixture_target", (("workload", "rlvr"),))] == 0.75
    assert m[("rb_broker_lease_held", ())] == 0

    fleet.backend("b0", capacity=7000, hold=True)
    fleet.start_broker("least_loaded")
    assert wait_until(lambda: samples(api.get("/metrics").text).get(
        ("rb_backend_sessions", (("backend", "b0"),))) == 5, timeout=20)
    m = samples(api.get("/metrics").text)
    assert m[("rb_backend_capacity_tokens", (("backend", "b0"),))] == 7000
    assert m[("rb_backend_admissions_total", (("backend", "b0"),))] == 5
    assert m[("rb_backend_reserved_tokens", (("backend", "b0"), ("workload", "rlvr")))] > 0
    assert m[("rb_backend_healthy", (("backend", "b0"),))] == 1
    assert m[("rb_backend_kv_usage_ratio", (("backend", "b0"),))] >= 0
    queries = m[("rb_backend_prefix_cache_queries_total", (("backend", "b0"),))]
    assert 0 <= m[("rb_backend_prefix_cache_hits_total", (("backend", "b0"),))] <= queries
    names = {name for name, _ in m}
    assert not names & {"rb_backend_kv_usage", "rb_backend_prefix_hit_rate",
                        "rb_throughput_sessions_per_second"}  # ratios and rates are not exported
    assert m[("rb_broker_lease_held", ())] == 1
    assert m[("rb_queue_depth", (("workload", "rlvr"),))] == 0


def test_session_latency_is_a_histogram_of_every_result(api, fleet):
    fleet.backend("b0")
    fleet.start_broker("least_loaded")
    api.post("/v1/sessions", json={"sessions": [session_json(i) for i in range(6)]})
    key = ("rb_session_latency_seconds_bucket", (("le", "+Inf"), ("workload", "rlvr")))
    assert wait_until(lambda: samples(api.get("/metrics").text).get(key) == 6, timeout=20)
    m = samples(api.get("/metrics").text)
    rlvr = sorted((float(dict(labels)["le"]), v) for (name, labels), v in m.items()
                  if name == "rb_session_latency_seconds_bucket"
                  and dict(labels)["workload"] == "rlvr")
    counts = [v for _, v in rlvr]
    assert counts == sorted(counts) and counts[-1] == 6  # cumulative, all six in +Inf
    assert rlvr[0][0] == 2.0 ** -7 and rlvr[-2][0] == 2.0 ** 12  # powers of two, then +Inf
    assert m[("rb_session_latency_seconds_bucket", (("le", "+Inf"), ("workload", "rlhf")))] == 0


def test_metrics_do_not_leak_into_the_global_registry(api):
    from prometheus_client import REGISTRY

    api.get("/metrics")
    assert REGISTRY.get_sample_value("rb_broker_lease_held") is None
