"""Redis unavailable: answers say so without its address, the log says it once per outage with
the detail, and the same app serves again once Redis is back."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from redis.exceptions import ConnectionError as RedisConnectionError

from api.app import create_app
from api.errors import RedisOutage
from api.settings import ApiSettings
from broker.redis_server import free_port, start_private_redis
from tests.api.helpers import session_json

LOGGER = "rollout_broker.api"


def outage_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


@pytest.mark.timeout(30)
def test_redis_down_answers_do_not_reveal_its_address(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    port = free_port()
    settings = ApiSettings(redis_url=f"redis://:hunter2@127.0.0.1:{port}/0")
    with TestClient(create_app(settings)) as client:
        answers = [client.get("/v1/status"), client.get("/readyz"), client.get("/v1/status"),
                   client.post("/v1/sessions", json={"sessions": [session_json(1)]})]
    for r in answers:
        assert r.status_code == 503, r.request.url
        for secret in (str(port), "127.0.0.1", "hunter2", "redis://"):
            assert secret not in r.text, (r.request.url, r.text)
        assert r.json()["reason"] == "redis: unavailable (ConnectionError)"
    assert answers[0].json()["field"] is None
    assert answers[1].json()["redis"] is False
    logged = outage_warnings(caplog)
    assert len(logged) == 1  # one outage, four failed requests
    assert str(port) in logged[0].getMessage() and "hunter2" not in logged[0].getMessage()


def test_an_outage_is_logged_again_only_after_redis_answered(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    outage = RedisOutage()
    for _ in range(3):
        outage.failed(RedisConnectionError("Error 111 connecting to 127.0.0.1:1."))
    assert len(outage_warnings(caplog)) == 1
    outage.answered()
    outage.answered()
    outage.failed(RedisConnectionError("Error 111 connecting to 127.0.0.1:1."))
    assert len(outage_warnings(caplog)) == 2
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [
        "redis: available again"]


def eventually_ok(client: TestClient, namespace: str, i: int, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        status = client.get("/v1/status")
        enqueue = client.post("/v1/sessions", json={"sessions": [session_json(i)]})
        if status.status_code == enqueue.status_code == 200:
            assert status.json()["namespace"] == namespace
            assert enqueue.json()["enqueued"] == [f"s{i}"]
            return
        assert time.monotonic() < deadline, (status.text, enqueue.text)
        time.sleep(0.1)


class RestartableRedis:
    """A private Redis the test stops (`stop`) and starts again on the same port (`start`)."""

    def __init__(self) -> None:
        self.handles = [start_private_redis()]
        self.url = self.handles[0].url
        self.port = int(self.url.rsplit(":", 1)[1].split("/")[0])

    def stop(self) -> None:
        self.handles[-1].process.terminate()
        self.handles[-1].process.wait(timeout=10)

    def start(self) -> None:
        self.handles.append(start_private_redis(port=self.port))

    def close(self) -> None:
        for h in self.handles:
            h.close()


@pytest.fixture
def restartable_redis() -> Iterator[RestartableRedis]:
    server = RestartableRedis()
    try:
        yield server
    finally:
        server.close()


@pytest.mark.redis
@pytest.mark.timeout(60)
def test_the_api_rides_out_a_redis_restart(caplog, restartable_redis):
    caplog.set_level(logging.INFO, logger=LOGGER)
    server = restartable_redis
    with TestClient(create_app(ApiSettings(redis_url=server.url, namespace="ride"))) as client:
        eventually_ok(client, "ride", 1, within_s=0)
        server.stop()
        for _ in range(2):
            for r in (client.get("/v1/status"),
                      client.post("/v1/sessions", json={"sessions": [session_json(2)]})):
                assert r.status_code == 503, r.text
                assert r.json() == {"field": None,
                                    "reason": "redis: unavailable (ConnectionError)"}
                assert r.headers["Retry-After"] == "1"
        assert len(outage_warnings(caplog)) == 1
        server.start()
        eventually_ok(client, "ride", 3)
        assert "redis: available again" in [r.getMessage() for r in caplog.records
                                            if r.name == LOGGER]


def _scrape(client: TestClient) -> dict[str, float]:
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@pytest.mark.redis
@pytest.mark.timeout(60)
def test_metrics_answer_through_an_outage_with_the_last_figures_and_redis_down(restartable_redis):
    server = restartable_redis
    with TestClient(create_app(ApiSettings(redis_url=server.url, namespace="scrape"))) as client:
        eventually_ok(client, "scrape", 1, within_s=0)
        before = _scrape(client)
        assert before["rb_redis_up"] == 1.0 and before['rb_queue_depth{workload="rlvr"}'] == 1
        server.stop()
        time.sleep(0.5)
        during = _scrape(client)  # no 503: Prometheus keeps its series
        assert during["rb_redis_up"] == 0.0
        assert during['rb_queue_depth{workload="rlvr"}'] == 1  # the last known
        assert during["rb_status_age_seconds"] >= 0.5
        assert during["process_resident_memory_bytes"] > 0
        server.start()
        deadline = time.monotonic() + 10
        while _scrape(client)["rb_redis_up"] != 1.0:
            assert time.monotonic() < deadline, "rb_redis_up stayed 0 after Redis returned"
            time.sleep(0.1)
