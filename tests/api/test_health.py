"""/healthz and /readyz."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import ApiSettings
from broker.keys import Keys
from broker.redis_server import free_port

pytestmark = pytest.mark.timeout(30)


@pytest.mark.redis
def test_ready_only_while_a_broker_holds_the_lease_and_a_worker_beats(api, redis_client,
                                                                      namespace):
    k = Keys(namespace)
    assert api.get("/healthz").json() == {"status": "ok"}
    r = api.get("/readyz")
    assert r.status_code == 503
    assert r.json()["redis"] is True and r.json()["broker_lease"] is False
    assert "lease" in r.json()["reason"]
    redis_client.set(k.lease, "tok", px=5000)
    redis_client.sadd(k.backends, "w0", "w1")  # registered, but no heartbeat: both gone
    r = api.get("/readyz")
    assert r.status_code == 503 and r.json()["broker_lease"] is True
    assert r.json()["live_workers"] == 0
    assert r.json()["reason"] == "workers: none beats (2 registered); nothing would run"
    redis_client.set(k.heartbeat("w1"), "{}", px=5000)
    r = api.get("/readyz")
    assert r.status_code == 200 and r.json()["ready"] is True and r.json()["live_workers"] == 1


def test_not_ready_without_redis():
    settings = ApiSettings(redis_url=f"redis://127.0.0.1:{free_port()}/0")
    with TestClient(create_app(settings)) as client:
        assert client.get("/healthz").status_code == 200
        r = client.get("/readyz")
        assert r.status_code == 503
        assert r.json()["redis"] is False and r.json()["reason"].startswith("redis:")


def test_creating_the_app_connects_to_nothing():
    app = create_app(ApiSettings(redis_url="redis://127.0.0.1:1/0"))  # nothing listens there
    assert app.state.rollout_client is None
    assert {"/v1/status", "/metrics", "/readyz"} <= set(app.openapi()["paths"])


def test_redis_down_is_a_json_503_on_every_endpoint_but_metrics():
    settings = ApiSettings(redis_url=f"redis://127.0.0.1:{free_port()}/0")
    with TestClient(create_app(settings)) as client:
        for path in ("/v1/status", "/v1/backends", "/v1/mixture"):
            r = client.get(path)
            assert r.status_code == 503, path
            assert r.json()["field"] is None and r.json()["reason"].startswith("redis:"), path
        # Prometheus keeps its series through an outage (tests/api/test_redis_outage.py).
        r = client.get("/metrics")
        assert r.status_code == 200 and "rb_redis_up 0.0" in r.text


@pytest.mark.redis
def test_shutdown_ends_even_when_a_step_of_it_hangs(settings, monkeypatch, caplog):
    """The API's shutdown always ends: a Redis client whose close never returns is left behind
    after SHUTDOWN_STEP_S, logged, and the rest of the shutdown still runs."""
    import asyncio
    import time

    import api.app

    monkeypatch.setattr(api.app, "SHUTDOWN_STEP_S", 0.3)

    async def never() -> None:
        await asyncio.Event().wait()

    client = TestClient(create_app(settings))
    with client:
        assert client.get("/healthz").status_code == 200
        client.app.state.redis.aclose = never
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 5
    assert "closing the Redis client took over 0.3s" in caplog.text
