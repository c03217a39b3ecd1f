"""`kill -9` of a worker process in the middle of 500 sessions: every session finishes once."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from broker.body import load_body
from broker.client import RolloutClient
from broker.keys import Keys
from broker.policies import make_policy
from broker.session import Session, SessionState
from tests.broker.helpers import BrokerThread, published, wait_until
from tests.workers.helpers import (
    kill_process_groups,
    mixed_sessions,
    prompt,
    start_worker,
    terminate_workers,
)

pytestmark = pytest.mark.timeout(150)
N = 500


@contextmanager
def broker_and_trainer(redis_url: str, namespace: str,
                       procs: dict[str, subprocess.Popen]) -> Iterator[RolloutClient]:
    """A broker thread and a trainer's client over the worker processes `procs` (which the
    test may add to); on the way out, everything stops and no process is left behind."""
    try:
        broker = BrokerThread(redis_url, namespace, make_policy("least_loaded"),
                              lease_s=1.0).start()
        client = RolloutClient(redis_url, namespace)
        try:
            yield client
        finally:
            broker.stop()
            terminate_workers(procs)
            client.close()
    finally:
        kill_process_groups(procs)  # a killed worker's engine child, if it outlived it


def test_kill_9_of_a_worker_mid_run(redis_url, namespace, redis_client):
    k = Keys(namespace)
    sessions = mixed_sessions(72)[:N]
    procs = {b: start_worker(redis_url, namespace, b) for b in ("w0", "w1")}
    got: list = []
    with broker_and_trainer(redis_url, namespace, procs) as client:

        def collect(n: int) -> bool:
            got.extend(client.results(N, timeout=0.3))
            return len(got) >= n

        assert wait_until(lambda: all(client.status()["backends"].get(b, {}).get("healthy")
                                      for b in procs), timeout=60)
        client.enqueue(sessions)
        assert wait_until(lambda: collect(N // 5), timeout=60, every=0)
        assert redis_client.hlen(k.ledger_sessions("w0")) > 0, "nothing left on w0 to lose"
        procs["w0"].send_signal(signal.SIGKILL)
        procs["w0"].wait()
        wait_until(lambda: collect(N), timeout=90, every=0)
        client.ack()
    ids = [r.session_id for r in got]
    assert len(ids) == N and len(set(ids)) == N, f"{len(ids)} results, {len(set(ids))} unique"
    assert published(redis_client, k) == N
    assert all(r.status == SessionState.done for r in got), \
        [r.error for r in got if r.status != SessionState.done][:3]
    assert any(r.backend_id == "w1" for r in got)
    assert int(redis_client.hget(k.ledger("w1"), "reserved")) == 0
    assert procs["w1"].returncode == 0, procs["w1"].stderr.read().decode()[-2000:]


def test_a_killed_worker_loses_no_turn_its_sessions_finished(redis_url, namespace, redis_client):
    """The worker checkpoints each multi-turn session after every turn whose tool answered;
    after `kill -9`, each session goes on elsewhere from its last checkpoint: its result
    begins with exactly the records the dead worker had checkpointed. The new worker serves
    policy version 1, so a turn run again would show it."""
    k = Keys(namespace)
    n = 12
    sessions = [Session(session_id=f"long-{i}", workload="agentic", prompt_token_ids=prompt(i, 300),
                        max_tokens=24, max_turns=8,
                        metadata={"tool": "sim", "sim_turns": 8,
                                  "sim_tool_latency_s": ",".join(["25"] * 7),  # 0.5 s at ×50
                                  "sim_observation_tokens": ",".join(["30"] * 7)})
                for i in range(n)]
    procs = {"w0": start_worker(redis_url, namespace, "w0")}
    got: list = []

    def checkpoints() -> dict[str, Session]:
        out = {}
        for s in sessions:
            body = redis_client.hget(k.session(s.session_id), "checkpoint")
            if body is not None:
                out[s.session_id] = load_body(body)
        return out

    with broker_and_trainer(redis_url, namespace, procs) as client:
        assert wait_until(lambda: client.status()["backends"].get("w0", {}).get("healthy"),
                          timeout=60)
        client.enqueue(sessions)
        assert wait_until(lambda: sum(c.resume_from.turn >= 2
                                      for c in checkpoints().values()) >= n // 2, timeout=60)
        procs["w0"].send_signal(signal.SIGKILL)
        procs["w0"].wait()
        kept = checkpoints()  # nothing writes them now; the broker has not reclaimed yet
        assert all(redis_client.hget(k.session(sid), "state") == b"running" for sid in kept)
        client.resume(1)  # new weights: every token generated from now on carries version 1
        procs["w1"] = start_worker(redis_url, namespace, "w1")

        def collect() -> bool:
            got.extend(client.results(n, timeout=0.3))
            return len(got) >= n

        assert wait_until(collect, timeout=90, every=0)
        client.ack()
    by_id = {r.session_id: r for r in got}
    assert len(got) == n == len(by_id)
    assert all(r.status == SessionState.done for r in got), [r.error for r in got][:3]
    assert len(kept) >= n // 2
    for sid, cp in kept.items():
        records = by_id[sid].turn_records
        done_on_w0 = len(cp.resume_from.turn_records)
        assert records[:done_on_w0] == cp.resume_from.turn_records, sid
        assert {r.policy_version for r in records[:done_on_w0]} == {0}
        assert {r.policy_version for r in records[done_on_w0:]} == {1}
        assert {r.turn for r in records} == set(range(8))
        assert by_id[sid].backend_id == "w1"
