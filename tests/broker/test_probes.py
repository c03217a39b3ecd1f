"""`rollout-broker probe broker|worker|tools`: healthy exactly while the role does its job."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from rollout_broker.cli import app
from broker.heartbeat import EngineMetrics
from broker.keys import Keys
from broker.worker_link import WorkerLink
from tests.broker.helpers import wait_until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


def probe(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, ["probe", *args])
    return res.exit_code, res.output.strip()


def test_broker_and_worker_probes(redis_url, namespace, redis_client):
    k = Keys(namespace)
    common = ["--redis-url", redis_url, "--namespace", namespace]
    assert probe("broker", *common) == (1, f"unhealthy: broker: no broker holds the lease of "
                                           f"namespace {namespace!r}")
    redis_client.set(k.lease, "tok", px=5000)
    assert probe("broker", *common) == (0, "healthy")
    assert probe("worker", *common, "--backend-id", "w0")[0] == 1
    link = WorkerLink(redis_url, namespace, "w0", heartbeat_ttl_s=1.0)
    link.register(1000, 4096)
    link.heartbeat(EngineMetrics(kv_usage=0.0, running=0, waiting=0, preemptions_total=0,
                                 prefix_queries_total=0, prefix_hits_total=0))
    assert probe("worker", *common, "--backend-id", "w0") == (0, "healthy")
    assert wait_until(lambda: probe("worker", *common, "--backend-id", "w0")[0] == 1, timeout=5)
    assert probe("broker", "--redis-url", "redis://127.0.0.1:1/0")[0] == 1  # Redis down


def test_the_tools_probe_follows_the_rq_worker_on_this_host(redis_url):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    before = probe("tools", "--redis-url", redis_url)[0]
    p = subprocess.Popen([sys.executable, "-m", "rollout_broker.cli", "tools", "--redis-url", redis_url],
                         cwd=root, env=dict(os.environ, PYTHONPATH=str(root)),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: probe("tools", "--redis-url", redis_url)[0] == 0, timeout=30)
    finally:
        p.terminate()
        p.wait(timeout=30)
    if before == 1:  # no other tool worker on this host: it leaves with this one
        assert wait_until(lambda: probe("tools", "--redis-url", redis_url)[0] == 1, timeout=10)
