"""The status script's edge cases, written straight into Redis."""

from __future__ import annotations

import json
import time

import pytest

from broker.keys import Keys
from broker.ledger import Ledger

pytestmark = [pytest.mark.redis, pytest.mark.timeout(30)]


def test_requeued_entries_count_with_their_original_enqueue_time(api, redis_client, namespace):
    k = Keys(namespace)
    api.get("/v1/status")  # the workloads set now exists (defaults)
    redis_client.sadd(k.workloads, "rlvr")
    redis_client.xadd(k.requeue("rlvr"), {"sid": "a", "session": "{}",
                                          "enqueued_at": repr(time.time() - 120)})
    w = {x["workload"]: x for x in api.get("/v1/status").json()["workloads"]}["rlvr"]
    assert w["depth"] == 1 and w["requeued"] == 1
    assert 119 < w["oldest_pending_age_s"] < 200


def test_new_backend_shows_at_once_and_odd_records_do_not_break_status(api, redis_client,
                                                                       namespace):
    k = Keys(namespace)
    assert api.get("/v1/backends").json() == []
    Ledger(redis_client, k).register_backend("b0", 1000, 4096)
    Ledger(redis_client, k).register_backend("b1", 2000, 4096)
    redis_client.set(k.heartbeat("b0"), "not json", px=5000)
    metrics = {"kv_usage": 0.25, "running": 2, "waiting": 1, "preemptions_total": 3,
               "prefix_queries_total": 10, "prefix_hits_total": 4}
    redis_client.set(k.heartbeat("b1"), json.dumps(
        {"backend_id": "b1", "at": time.time() - 0.5, "metrics": metrics,
         "sessions": [{"session_id": "x", "context_tokens": 1, "generated_tokens": 0,
                       "turn": 1, "waiting_on_tool": False}]}), px=5000)
    redis_client.delete(k.admitted("b1"))
    redis_client.sadd(k.backends, "bad:id")  # not a valid id: skipped, not a 500
    by_id = {b["backend_id"]: b for b in api.get("/v1/backends").json()}
    assert set(by_id) == {"b0", "b1"}
    assert by_id["b0"]["healthy"] is False and by_id["b0"]["kv_usage"] is None
    b1 = by_id["b1"]
    assert b1["healthy"] and b1["kv_usage"] == 0.25 and b1["prefix_hit_rate"] == 0.4
    assert 0.4 < b1["heartbeat_age_s"] < 5
    assert b1["admitted_total"] is None and by_id["b0"]["admitted_total"] == 0
