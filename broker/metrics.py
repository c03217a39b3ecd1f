"""The broker's and the workers' own Prometheus metrics, on a registry of their own that
`serve_metrics` exposes over HTTP (`--metrics-port`). The API's `/metrics` exports the
namespace's state as Redis holds it (queues, ledger, engines' counters); these are what only
the processes see: admission and queue wait, decide() time, tokens generated, session and turn
latency, failures and hand-backs. Counters end in `_total` (for `rate()`), durations are
histograms in seconds."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry(auto_describe=True)

_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
_DURATION_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)

# -- broker --------------------------------------------------------------------------------------
ADMISSIONS = Counter("rb_broker_admissions", "sessions the broker admitted", ["workload"],
                     registry=REGISTRY)
QUEUE_WAIT = Histogram("rb_broker_queue_wait_seconds", "enqueue to admission", ["workload"],
                       buckets=_WAIT_BUCKETS, registry=REGISTRY)
DECIDE = Histogram("rb_broker_decide_seconds", "time in the policy's decide()",
                   buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1),
                   registry=REGISTRY)
ACTIVE = Gauge("rb_broker_active", "1 while this broker holds the lease (active), else 0",
               ["policy"], registry=REGISTRY)
REQUEUED = Counter("rb_broker_requeued_sessions",
                   "sessions the broker took back from a backend", ["reason"], registry=REGISTRY)
EPISODES_RELEASED = Counter("rb_broker_episodes_released",
                            "agent-driven episodes whose KV charge the broker released after "
                            "their agent idled", registry=REGISTRY)

# -- workers -------------------------------------------------------------------------------------
SESSIONS = Counter("rb_worker_sessions", "sessions a worker finished and published",
                   ["workload", "status"], registry=REGISTRY)
GENERATED = Counter("rb_worker_generated_tokens", "output tokens of published sessions",
                    ["workload"], registry=REGISTRY)
SESSION_SECONDS = Histogram("rb_worker_session_duration_seconds",
                            "a session's run on this worker, first request to result",
                            ["workload"], buckets=_DURATION_BUCKETS, registry=REGISTRY)
TURN_SECONDS = Histogram("rb_worker_turn_seconds", "one turn's engine request, sent to answered",
                         ["workload"], buckets=_DURATION_BUCKETS, registry=REGISTRY)
HANDED_BACK = Counter("rb_worker_handed_back_sessions",
                      "sessions a worker gave back to the queue", ["reason"], registry=REGISTRY)
RUNNING = Gauge("rb_worker_running_sessions", "sessions running on this worker",
                registry=REGISTRY)


def serve_metrics(port: int, host: str = "0.0.0.0") -> None:
    """Serve REGISTRY as Prometheus text on http://host:port/metrics (a daemon thread)."""
    start_http_server(port, addr=host, registry=REGISTRY)
