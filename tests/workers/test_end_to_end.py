"""Broker + two workers on two simulated engines, real Redis: every workload completes."""

from __future__ import annotations

import pytest

from broker.client import RolloutClient
from broker.policies import make_policy
from broker.session import SessionState
from sim.server.testing import running_engine
from tests.broker.helpers import BrokerThread, wait_until
from tests.workers.helpers import WorkerThread, generation_tokens, mixed_sessions

pytestmark = pytest.mark.timeout(120)


def test_two_engines_all_workloads_tokens_match_engine_counters(redis_url, namespace,
                                                                 redis_client):
    from broker.metrics import REGISTRY

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    workloads = ("rlvr", "rlhf", "agentic")
    before = {w: (sample("rb_worker_sessions_total", workload=w, status="done"),
                  sample("rb_worker_generated_tokens_total", workload=w),
                  sample("rb_broker_admissions_total", workload=w),
                  sample("rb_worker_session_duration_seconds_count", workload=w))
              for w in workloads}
    sessions = mixed_sessions(6)
    with running_engine(time_scale=200.0, kv_tokens=60_000) as e0, \
            running_engine(time_scale=200.0, kv_tokens=60_000) as e1:
        engines = {"w0": e0, "w1": e1}
        workers = [WorkerThread(redis_url, namespace, b, e.url).start() for b, e in engines.items()]
        broker = BrokerThread(redis_url, namespace, make_policy("least_loaded")).start()
        client = RolloutClient(redis_url, namespace)
        got = []
        try:
            assert wait_until(lambda: all(client.status()["backends"].get(b, {}).get("healthy")
                                          for b in engines), timeout=30)
            client.enqueue(sessions)
            assert wait_until(lambda: len(got.__iadd__(client.results(len(sessions), timeout=0.5))
                                          or got) >= len(sessions), timeout=60, every=0)
            client.ack()
        finally:
            broker.stop()
            for w in workers:
                w.stop()
            client.close()
        assert sorted(r.session_id for r in got) == sorted(s.session_id for s in sessions)
        bad = [(r.session_id, r.error) for r in got if r.status != SessionState.done]
        assert not bad
        assert {r.workload for r in got} == {"rlvr", "rlhf", "agentic"}
        for b, e in engines.items():
            mine = [r for r in got if r.backend_id == b]
            assert mine, f"{b} ran nothing"
            assert sum(r.output_tokens for r in mine) == generation_tokens(e.url)
        for r in got:
            assert r.output_tokens == sum(len(t) for t in r.output_token_ids) > 0
            if r.workload == "agentic":
                assert r.turns == 3 and r.cached_tokens > 0, r
            else:
                assert r.turns == 1
        for w in workloads:  # the processes' own metrics counted each session once
            mine = [r for r in got if r.workload == w]
            after = (sample("rb_worker_sessions_total", workload=w, status="done"),
                     sample("rb_worker_generated_tokens_total", workload=w),
                     sample("rb_broker_admissions_total", workload=w),
                     sample("rb_worker_session_duration_seconds_count", workload=w))
            assert [a - b for a, b in zip(after, before[w])] == [
                len(mine), sum(r.output_tokens for r in mine), len(mine), len(mine)], w
        for b in engines:  # every reservation was released by the finishes
            assert int(redis_client.hget(f"rb:{{{namespace}}}:ledger:{b}", "reserved")) == 0
