"""Redis at its `maxmemory` (noeviction): enqueue answers 503 saying so, what was accepted before
is kept (the fleet waits: Redis refuses the heartbeats and starts that need memory too), and
once memory frees enqueue works again and every session runs exactly once."""

from __future__ import annotations

import pytest
import redis
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import ApiSettings
from broker.client import RolloutClient
from broker.heartbeat import EngineMetrics
from broker.redis_server import start_private_redis
from broker.session import SessionResult, SessionState
from broker.worker_link import WorkerLink
from tests.api.helpers import session_json
from tests.broker.helpers import BrokerThread, wait_until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(90)]

NS = "full"
METRICS = EngineMetrics(kv_usage=0.1, running=0, waiting=0, preemptions_total=0,
                        prefix_queries_total=0, prefix_hits_total=0)


def run_admitted(link: WorkerLink) -> int:
    """What a worker does, minus the engine: beat, and finish every session admitted here."""
    link.heartbeat(METRICS)
    admitted = link.read_admitted(count=64, block_ms=None)
    for a in admitted:
        s = a.session
        assert link.finish(SessionResult(session_id=s.session_id, workload=s.workload,
                                         status=SessionState.done)) == "ok"
    return len(admitted)


def test_enqueue_at_maxmemory_is_a_503_and_nothing_accepted_is_lost():
    handle = start_private_redis(extra_args=("--maxmemory-policy", "noeviction"))
    r = redis.Redis.from_url(handle.url)
    broker = BrokerThread(handle.url, NS)
    link = WorkerLink(handle.url, NS, "w0")
    trainer = None
    try:
        link.register(10_000, 4096)
        with TestClient(create_app(ApiSettings(redis_url=handle.url, namespace=NS))) as api:
            accepted = api.post("/v1/sessions",
                                json={"sessions": [session_json(i) for i in range(5)]})
            assert accepted.status_code == 200, accepted.text
            trainer = RolloutClient(handle.url, NS)
            r.config_set("maxmemory", 1)  # every write that needs memory is refused from now on

            refused = api.post("/v1/sessions", json={"sessions": [session_json(5)]})
            assert refused.status_code == 503, refused.text
            assert refused.json()["field"] is None
            assert refused.json()["reason"].startswith("redis: out of memory (maxmemory reached)")
            assert refused.headers["Retry-After"] == "1"
            assert not r.exists(f"rb:{{{NS}}}:session:s5")

            broker.start()
            with pytest.raises(redis.RedisError, match="OOM"):
                run_admitted(link)  # a heartbeat needs memory: the fleet waits
            assert api.get("/v1/status").status_code == 200  # reads still answer
            states = {r.hget(f"rb:{{{NS}}}:session:s{i}", "state") for i in range(5)}
            assert states <= {b"pending", b"admitted"}, states  # kept

            r.config_set("maxmemory", 0)  # memory frees
            again = api.post("/v1/sessions", json={"sessions": [session_json(5)]})
            assert again.status_code == 200 and again.json()["enqueued"] == ["s5"], again.text
            got: list[SessionResult] = []
            assert wait_until(lambda: run_admitted(link) >= 0 and (
                got.extend(trainer.results(8, timeout=0.2)) or len(got) >= 6), timeout=30)
            trainer.ack()
        assert sorted(x.session_id for x in got) == [f"s{i}" for i in range(6)]  # each once
    finally:
        broker.stop_event.set()
        if broker.thread.is_alive():
            broker.stop()
        if trainer is not None:
            trainer.close()
        link.close()
        r.close()
        handle.close()
