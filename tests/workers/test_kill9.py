"""`kill -9` of a worker process in the middle of 500 sessions: every session finishes once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from broker.client import RolloutClient
from broker.keys import Keys
from broker.policies import make_policy
from broker.session import SessionState
from tests.broker.helpers import BrokerThread, wait_until
from tests.workers.helpers import mixed_sessions

pytestmark = pytest.mark.timeout(150)
ROOT = Path(__file__).resolve().parents[2]
N = 500


def start_worker(redis_url: str, namespace: str, backend_id: str, tool_time_scale: str = "50"
                 ) -> subprocess.Popen:
    """A worker process that starts its own simulated engine (a child in its process group)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "broker.cli", "worker", "--backend-id", backend_id,
         "--engine", "sim:h100-8b", "--kv-tokens", "40000", "--redis-url", redis_url, "--namespace", namespace,
         "--time-scale", tool_time_scale, "--heartbeat-s", "0.25", "--heartbeat-ttl", "2.0",
         "--drain-grace", "5", "--log-level", "WARNING"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True)


def test_kill_9_of_a_worker_mid_run(redis_url, namespace, redis_client):
    k = Keys(namespace)
    sessions = mixed_sessions(72)[:N]
    procs = {b: start_worker(redis_url, namespace, b) for b in ("w0", "w1")}
    got: list = []
    try:
        broker = BrokerThread(redis_url, namespace, make_policy("least_loaded"),
                              lease_s=1.0).start()
        client = RolloutClient(redis_url, namespace)

        def collect(n: int) -> bool:
            got.extend(client.results(N, timeout=0.3))
            return len(got) >= n

        try:
            assert wait_until(lambda: all(client.status()["backends"].get(b, {}).get("healthy")
                                          for b in procs), timeout=60)
            client.enqueue(sessions)
            assert wait_until(lambda: collect(N // 5), timeout=60, every=0)
            assert redis_client.hlen(k.ledger_sessions("w0")) > 0, "nothing left on w0 to lose"
            procs["w0"].send_signal(signal.SIGKILL)
            procs["w0"].wait()
            wait_until(lambda: collect(N), timeout=90, every=0)
            client.ack()
        finally:
            broker.stop()
            for p in procs.values():
                if p.poll() is None:
                    p.terminate()
                    p.wait(timeout=60)
            client.close()
    finally:
        for p in procs.values():  # the killed worker's engine child, if it outlived it
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    ids = [r.session_id for r in got]
    assert len(ids) == N and len(set(ids)) == N, f"{len(ids)} results, {len(set(ids))} unique"
    assert redis_client.xlen(k.results) == N
    assert all(r.status == SessionState.done for r in got), \
        [r.error for r in got if r.status != SessionState.done][:3]
    assert any(r.backend_id == "w1" for r in got)
    assert int(redis_client.hget(k.ledger("w1"), "reserved")) == 0
    assert procs["w1"].returncode == 0, procs["w1"].stderr.read().decode()[-2000:]
