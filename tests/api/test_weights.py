"""POST /v1/weights/pause and /resume, GET /v1/weights: the client's weight-update calls."""

from __future__ import annotations

import pytest

from broker.heartbeat import EngineMetrics
from broker.worker_link import WorkerLink
from tests.broker.helpers import wait_until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


def test_pause_then_resume_records_the_mode_and_the_new_version(api):
    none = {"max_staleness": None, "paused_backends": [], "paused_adapters": {}}
    assert api.get("/v1/weights").json() == {"paused": "", "version": None, **none}
    r = api.post("/v1/weights/pause", json={"mode": "abort"})
    assert r.status_code == 200, r.text
    assert r.json() == {"paused": "abort", "version": None, **none}
    r = api.post("/v1/weights/resume", json={"version": 7})
    assert r.json() == {"paused": "", "version": 7, **none}
    assert api.get("/v1/weights").json()["version"] == 7
    r = api.put("/v1/weights/staleness", json={"max_staleness": 2})
    assert r.status_code == 200 and r.json()["max_staleness"] == 2
    assert api.put("/v1/weights/staleness", json={"max_staleness": None}).json()[
        "max_staleness"] is None


def test_pause_waits_for_every_live_backend_and_names_one_that_does_not_pause(
        api, fleet, redis_url, namespace):
    fleet.backend("b0")  # a simulated backend: acknowledges pauses on its next beat
    mute = WorkerLink(redis_url, namespace, "mute", heartbeat_ttl_s=30.0)
    mute.register(4000, 32768)
    assert wait_until(lambda: len(api.get("/v1/backends").json()) == 2, timeout=10)
    mute.heartbeat(EngineMetrics(kv_usage=0.0, running=0, waiting=0, preemptions_total=0,
                                 prefix_queries_total=0, prefix_hits_total=0))  # alive, deaf
    r = api.post("/v1/weights/pause", json={"mode": "keep", "timeout_s": 1.0})
    assert r.status_code == 409
    assert r.json()["field"] == "timeout_s"
    assert "engines of mute not paused" in r.json()["reason"]  # b0 did pause
    mute.withdraw()
    r = api.post("/v1/weights/pause", json={"mode": "keep", "timeout_s": 5.0})
    assert r.status_code == 200 and r.json()["paused_backends"] == ["b0"]
    mute.close()


@pytest.mark.parametrize("path, body, field", [
    ("/v1/weights/pause", {"mode": "sleep"}, "mode"),
    ("/v1/weights/pause", {"timeout_s": 0}, "timeout_s"),
    ("/v1/weights/resume", {"version": -1}, "version"),
    ("/v1/weights/resume", {}, "version"),
    ("/v1/weights/staleness", {"max_staleness": -1}, "max_staleness"),
])
def test_bad_bodies_name_the_field(api, path, body, field):
    call = api.put if path.endswith("staleness") else api.post
    r = call(path, json=body)
    assert r.status_code == 422 and r.json()["field"] == field


def test_an_adapter_pause_and_resume_over_http(api, redis_url, namespace):
    from broker.client import RolloutClient

    r = api.post("/v1/weights/adapters/x/pause", json={"mode": "abort"})
    assert r.status_code == 422 and r.json()["field"] == "adapter", r.text  # not registered
    client = RolloutClient(redis_url, namespace)
    try:
        client.register_adapter("x", "/ckpt/x")
    finally:
        client.close()
    r = api.post("/v1/weights/adapters/x/pause", json={"mode": "abort"})
    assert r.status_code == 200, r.text
    assert r.json()["paused_adapters"] == {"x": "abort"} and r.json()["paused"] == ""
    assert api.get("/v1/weights").json()["paused_adapters"] == {"x": "abort"}
    r = api.post("/v1/weights/adapters/x/resume")
    assert r.status_code == 200 and r.json()["paused_adapters"] == {}
    r = api.post("/v1/weights/adapters/a%20b/resume")
    assert r.status_code == 422 and r.json()["field"] == "adapter"
