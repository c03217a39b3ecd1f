"""A dead or slow engine costs no session: sessions go back to the queue, never `failed`, and a
slow /metrics never stops a healthy worker's heartbeat."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from broker.client import RolloutClient
from broker.keys import Keys
from broker.policies import make_policy
from broker.redis_server import free_port
from broker.session import Session, SessionState
from sim.server.testing import running_engine
from tests.broker.helpers import BrokerThread, wait_until
from tests.workers.helpers import ROOT, WorkerThread, prompt

pytestmark = [pytest.mark.redis, pytest.mark.integration, pytest.mark.timeout(150)]


def engine_process(port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rollout_broker.cli", "sim-engine", "--port", str(port), "--profile",
         "h100-8b", "--time-scale", "200", "--kv-tokens", "60000"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)


def wait_health(url: str) -> None:
    assert wait_until(lambda: _answers(url), timeout=60), f"{url} did not start"


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def episodes(n: int) -> list[Session]:
    """Two-turn episodes whose tool takes 400 simulated s (2 s of wall time at ×200): many
    are mid-episode, on their engine, when it dies."""
    return [Session(session_id=f"e{i}", workload="agentic", prompt_token_ids=prompt(i, 100),
                    max_tokens=16, max_turns=2,
                    metadata={"tool": "sim", "sim_turns": 2, "sim_tool_latency_s": "400",
                              "sim_observation_tokens": "8"}) for i in range(n)]


def test_a_killed_engine_hands_its_sessions_back_and_its_worker_resumes_when_it_returns(
        redis_url, namespace, redis_client):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = engine_process(port)
    batch = episodes(40)
    got = []
    k = Keys(namespace)
    try:
        wait_health(url)
        with running_engine(time_scale=200.0, kv_tokens=60_000) as healthy:
            w0 = WorkerThread(redis_url, namespace, "w0", url).start()
            w1 = WorkerThread(redis_url, namespace, "w1", healthy.url).start()
            broker = BrokerThread(redis_url, namespace, make_policy("least_loaded"),
                                  lease_s=1.0).start()
            client = RolloutClient(redis_url, namespace)
            try:
                assert wait_until(lambda: all(client.status()["backends"].get(b, {})
                                              .get("healthy") for b in ("w0", "w1")), timeout=30)
                client.enqueue(batch)
                assert wait_until(lambda: redis_client.hlen(k.ledger_sessions("w0")) >= 5)
                os.killpg(proc.pid, 9)
                proc.wait()
                assert wait_until(lambda: got.extend(client.results(100, timeout=0.2)) or
                                  len(got) >= len(batch), timeout=90, every=0)
                assert w0.worker.counters.engine_down == 1
                assert not redis_client.exists(k.heartbeat("w0"))  # admits nothing there now
                proc = engine_process(port)  # the engine comes back on its address
                wait_health(url)
                assert wait_until(lambda: redis_client.exists(k.heartbeat("w0")), timeout=30)
                assert w0.worker.engine_up
                client.ack()
            finally:
                broker.stop()
                w0.stop()
                w1.stop()
                client.close()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert sorted(r.session_id for r in got) == sorted(s.session_id for s in batch)
    assert [(r.session_id, r.error) for r in got if r.status != SessionState.done] == []
    requeued = [s.session_id for s in batch
                if redis_client.hget(k.session(s.session_id), "requeued_from") == b"w0"]
    assert requeued  # those w0 held were run again on w1, not failed


def test_a_slow_metrics_endpoint_does_not_stop_the_heartbeat(redis_url, namespace, redis_client):
    k = Keys(namespace)
    with running_engine(time_scale=200.0, kv_tokens=60_000, fault_injection=True) as engine:
        w0 = WorkerThread(redis_url, namespace, "w0", engine.url).start()
        client = RolloutClient(redis_url, namespace)
        try:
            assert wait_until(lambda: redis_client.exists(k.heartbeat("w0")), timeout=30)
            httpx.post(f"{engine.url}/sim/faults", json={"metrics_delay_s": 12.0},
                       timeout=5).raise_for_status()
            stalled_from = time.monotonic()
            gaps, lags = [], []
            while time.monotonic() - stalled_from < 14.0:
                raw = redis_client.get(k.heartbeat("w0"))
                if raw is None:
                    gaps.append(round(time.monotonic() - stalled_from, 1))
                else:
                    beat = json.loads(raw)
                    lags.append(beat["sent_at"] - beat["at"])
                time.sleep(0.1)
            httpx.post(f"{engine.url}/sim/faults", json={"metrics_delay_s": 0.0},
                       timeout=20).raise_for_status()
        finally:
            w0.stop()
            client.close()
    assert gaps == []  # the backend never looked dead
    assert w0.worker.counters.engine_down == 0
    assert max(lags) > 5.0  # the beats went on, carrying ever older numbers with their age
