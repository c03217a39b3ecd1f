"""SIGTERM drains a worker: short sessions finish, long ones are handed back and run elsewhere."""

from __future__ import annotations

import json
import signal
import time

import pytest

from broker.client import RolloutClient
from broker.keys import Keys
from broker.policies import make_policy
from broker.policies.least_loaded import LeastLoaded
from broker.session import Session, SessionState
from tests.broker.helpers import BrokerThread, published, wait_until
from sim.server.testing import running_engine
from tests.workers.helpers import (
    WorkerThread,
    kill_process_groups,
    prompt,
    start_worker,
    terminate_workers,
)

pytestmark = pytest.mark.timeout(120)


def test_sigterm_finishes_what_it_can_and_hands_back_the_rest(redis_url, namespace, redis_client):
    k = Keys(namespace)
    short = [Session(session_id=f"short-{i}", workload="rlhf", prompt_token_ids=prompt(i, 64),
                     max_tokens=8, metadata={"sim_output_tokens": "8"}) for i in range(10)]
    # Held by a tool that sleeps 1,000 simulated seconds (20 s of wall time at ×50): past the
    # 5 s drain grace. The second worker runs at ×100,000, so the same tool takes 10 ms there.
    long = [Session(session_id=f"long-{i}", workload="agentic", prompt_token_ids=prompt(100 + i, 64),
                    max_tokens=8, max_turns=2,
                    metadata={"tool": "sim", "sim_turns": 2, "sim_tool_latency_s": "1000",
                              "sim_observation_tokens": "8"}) for i in range(6)]
    procs = {"w0": start_worker(redis_url, namespace, "w0")}
    broker = BrokerThread(redis_url, namespace, make_policy("least_loaded"), lease_s=1.0).start()
    client = RolloutClient(redis_url, namespace)
    got: list = []
    try:
        assert wait_until(lambda: client.status()["backends"].get("w0", {}).get("healthy"),
                          timeout=60)
        client.enqueue(short + long)
        assert wait_until(lambda: got.extend(client.results(20, timeout=0.2)) or len(got) >= 10,
                          timeout=30, every=0)
        assert wait_until(lambda: redis_client.hlen(k.ledger_sessions("w0")) == len(long))
        t0 = time.monotonic()
        procs["w0"].send_signal(signal.SIGTERM)
        assert procs["w0"].wait(timeout=30) == 0
        drained_s = time.monotonic() - t0
        # handed back at once (withdraw), not after the heartbeat TTL: pending again
        assert wait_until(lambda: sum(client.status()["pending"].values()) == len(long),
                          timeout=10)
        assert redis_client.hlen(k.ledger_sessions("w0")) == 0
        procs["w1"] = start_worker(redis_url, namespace, "w1", tool_time_scale="100000")
        assert wait_until(lambda: got.extend(client.results(20, timeout=0.3)) or len(got) >= 16,
                          timeout=60, every=0)
        client.ack()
    finally:
        broker.stop()
        terminate_workers(procs)
        kill_process_groups(procs)
        client.close()
    assert drained_s < 20
    assert sorted(r.session_id for r in got) == sorted(s.session_id for s in short + long)
    assert all(r.status == SessionState.done for r in got)
    assert {r.backend_id for r in got if r.session_id.startswith("long")} == {"w1"}
    assert published(redis_client, k) == 16



def test_a_draining_worker_is_sent_no_new_session(redis_url, namespace, redis_client):
    """While a worker drains (a session still running within its grace), its heartbeats say
    so and the broker places every new session elsewhere."""
    k = Keys(namespace)
    # Held by a tool that sleeps 1,000 simulated seconds (20 s here at ×50): inside the grace.
    held = Session(session_id="held", workload="agentic", prompt_token_ids=prompt(7, 64),
                   max_tokens=8, max_turns=2,
                   metadata={"tool": "sim", "sim_turns": 2, "sim_tool_latency_s": "1000",
                             "sim_observation_tokens": "8"})
    fresh = [Session(session_id=f"new-{i}", workload="rlhf", prompt_token_ids=prompt(i, 64),
                     max_tokens=8) for i in range(12)]
    with running_engine(time_scale=50.0) as e0, running_engine(time_scale=50.0) as e1:
        w0 = WorkerThread(redis_url, namespace, "w0", e0.url, time_scale=50.0,
                          drain_grace_s=2.0, handoff_s=1.0).start()
        placed: list[tuple[str, str]] = []  # every (session, backend) the policy chose

        class Recording(LeastLoaded):
            def decide(self, snapshot):
                decision = super().decide(snapshot)
                placed.extend((a.session_id, a.backend_id) for a in decision.admissions)
                return decision

        broker = BrokerThread(redis_url, namespace, Recording()).start()
        client = RolloutClient(redis_url, namespace)
        w1 = None
        try:
            assert wait_until(lambda: client.status()["backends"].get("w0", {}).get("healthy"),
                              timeout=30)
            client.enqueue([held])
            assert wait_until(lambda: redis_client.hlen(k.ledger_sessions("w0")) == 1)
            w1 = WorkerThread(redis_url, namespace, "w1", e1.url, time_scale=50.0).start()
            assert wait_until(lambda: client.status()["backends"].get("w1", {}).get("healthy"),
                              timeout=30)
            w0._loop.call_soon_threadsafe(w0._stop.set)  # SIGTERM: w0 drains for 2 s
            time.sleep(1.0)  # it stops pulling within a read (0.25 s) and beats at once
            assert json.loads(redis_client.get(k.heartbeat("w0")))["draining"] is True
            client.enqueue(fresh)
            got: list = []
            assert wait_until(lambda: got.extend(client.results(12, timeout=0.2))
                              or len(got) >= 12, timeout=30, every=0)
            client.ack()
            assert {r.backend_id for r in got} == {"w1"}
            assert {b for sid, b in placed if sid.startswith("new-")} == {"w1"}
            assert all(r.status == SessionState.done for r in got)
        finally:
            broker.stop()
            w0.stop()
            if w1 is not None:
                w1.stop()
            client.close()
