"""Small helpers for the API tests."""

from __future__ import annotations

from api.models import (
    BackendStatus,
    BrokerStatus,
    MixtureStatus,
    StatusPublic,
    WorkloadStatus,
)
from broker.session import Session


def session_json(i: int, workload: str = "rlvr", prompt_len: int = 8, max_tokens: int = 16,
                 prefix: str = "s") -> dict:
    return Session(session_id=f"{prefix}{i}", workload=workload,
                   prompt_token_ids=list(range(1, prompt_len + 1)),
                   max_tokens=max_tokens).model_dump(mode="json")


def sample_status() -> StatusPublic:
    """A status with every part filled: a workload with sessions waiting, a backend with one
    resident (what the metrics tests render, each labelled series present)."""
    return StatusPublic(
        at=0.0, namespace="ns", broker=BrokerStatus(lease_held=True),
        workloads=[WorkloadStatus(workload="rlvr", depth=3, requeued=1, oldest_pending_age_s=9.0,
                                  finished_total=1, failed_total=0, consumed_total=1)],
        backends=[BackendStatus(
            backend_id="b0", healthy=True, capacity_tokens=10, max_model_len=10, alpha=1.0,
            limit_tokens=10, reserved_tokens=1, reserved_by_workload={"rlvr": 1}, sessions=1,
            admitted_total=1, kv_usage=0.1, running=1, waiting=0, preemptions_total=0,
            prefix_hit_rate=0.5, prefix_cache_queries_total=2, prefix_cache_hits_total=1,
            heartbeat_age_s=0.1)],
        mixture=MixtureStatus(target={"rlvr": 1.0}, consumed_total={"rlvr": 1},
                              consumed_window={"rlvr": 1}, window_s=60.0, drift_total=0.0,
                              drift_window=0.0),
        throughput=[], results_unacknowledged=1, dead_letter=0)
