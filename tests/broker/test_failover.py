"""`kill -9` of the active broker process mid-run: the standby takes over, nothing is lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sim.backend import SimulatedBackend
from broker.client import RolloutClient
from broker.keys import Keys
from tests.broker.helpers import make_session, wait_until

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
LEASE_S = 1.0
N = 2000


def start_broker(redis_url: str, namespace: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "rollout_broker.cli", "broker", "--redis-url", redis_url,
         "--namespace", namespace, "--policy", "tests.broker.policies_for_tests:HeadroomPolicy",
         "--lease-s", str(LEASE_S), "--log-level", "WARNING"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_kill_9_of_the_active_broker(redis_url, namespace, redis_client):
    k = Keys(namespace)
    backends = [SimulatedBackend(redis_url, namespace, f"b{i}", 3000, service_s=0.02).start()
                for i in range(4)]
    first = start_broker(redis_url, namespace)
    second = None
    client = RolloutClient(redis_url, namespace)
    got: list = []
    try:
        assert wait_until(lambda: redis_client.exists(k.lease) == 1, timeout=30)
        first_token = redis_client.get(k.lease)
        second = start_broker(redis_url, namespace)  # standby: the lease is taken
        for start in range(0, N, 200):
            client.enqueue([make_session(i, workload=("rlvr", "rlhf", "agentic")[i % 3])
                            for i in range(start, start + 200)])
        assert wait_until(lambda: len(got.__iadd__(client.results(N // 4, timeout=0.2)) or got)
                          >= N // 4, timeout=60, every=0)
        assert sum(client.status()["pending"].values()) > 0  # killed mid-run, work left
        first.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        first.wait()
        assert wait_until(lambda: redis_client.get(k.lease) not in (None, first_token),
                          timeout=10, every=0.01)
        takeover_s = time.monotonic() - killed_at
        print(f"takeover after kill -9: {takeover_s:.2f}s (lease {LEASE_S}s)")
        assert takeover_s <= 2 * LEASE_S, f"standby took {takeover_s:.2f}s"
        wait_until(lambda: len(got.__iadd__(client.results(N, timeout=0.3)) or got) >= N,
                   timeout=60, every=0)
        client.ack()
        ids = [r.session_id for r in got]
        assert len(ids) == N and len(set(ids)) == N
        assert redis_client.xlen(k.results) == N
        for b in range(4):
            assert int(redis_client.hget(k.ledger(f"b{b}"), "reserved")) == 0
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(timeout=10)
        for b in backends:
            b.stop()
        client.close()
