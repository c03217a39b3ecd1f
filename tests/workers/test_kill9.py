"""`kill -9` of a worker process in the middle of 500 sessions: every session finishes once."""

from __future__ import annotations

import signal

import pytest

from broker.client import RolloutClient
from broker.keys import Keys
from broker.policies import make_policy
from broker.session import SessionState
from tests.broker.helpers import BrokerThread, wait_until
from tests.workers.helpers import (
    kill_process_groups,
    mixed_sessions,
    start_worker,
    terminate_workers,
)

pytestmark = pytest.mark.timeout(150)
N = 500


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
            terminate_workers(procs)
            client.close()
    finally:
        kill_process_groups(procs)  # the killed worker's engine child, if it outlived it
    ids = [r.session_id for r in got]
    assert len(ids) == N and len(set(ids)) == N, f"{len(ids)} results, {len(set(ids))} unique"
    assert redis_client.xlen(k.results) == N
    assert all(r.status == SessionState.done for r in got), \
        [r.error for r in got if r.status != SessionState.done][:3]
    assert any(r.backend_id == "w1" for r in got)
    assert int(redis_client.hget(k.ledger("w1"), "reserved")) == 0
    assert procs["w1"].returncode == 0, procs["w1"].stderr.read().decode()[-2000:]
