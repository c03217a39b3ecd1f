"""GET /metrics: the status as Prometheus text, from a registry made for each request (the
process-global registry would mix in whatever else the process registers).

Prometheus naming: counters end in `_total` and are meant for `rate()`; ratios are exported as
the counters they divide (prefix cache hits and queries), so they aggregate over backends;
a 0..1 gauge ends in `_ratio`.

It always answers 200, so that Prometheus has data exactly when an operator needs it: with
Redis down, the process's own figures (`process_*`), the last status read with its age
(`rb_status_age_seconds`), and `rb_redis_up 0`."""

from __future__ import annotations

import time
from collections.abc import Iterator

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from api.deps import StatusReaderDep
from api.models import StatusPublic
from broker import latency

router = APIRouter(tags=["metrics"])

_BACKEND_GAUGES = (  # (metric suffix, BackendStatus field, help)
    ("capacity_tokens", "capacity_tokens", "KV capacity C_b in tokens"),
    ("alpha", "alpha", "admission factor: reservations may reach alpha*C_b"),
    ("limit_tokens", "limit_tokens", "floor(alpha*C_b)"),
    ("sessions", "sessions", "sessions holding a reservation"),
    ("kv_usage_ratio", "kv_usage",
     "engine KV cache usage, 0..1 (shared engine: of this namespace's part, above 1 when over)"),
    ("running", "running", "engine requests running"),
    ("waiting", "waiting", "engine requests waiting"),
    ("heartbeat_age_seconds", "heartbeat_age_s", "seconds since the metrics in the last heartbeat"),
    ("share_ratio", "share", "on an engine namespaces share: this namespace's guaranteed share"),
    ("part_tokens", "part_tokens", "on an engine namespaces share: the KV tokens this namespace may plan against now"),
)


class StatusCollector(Collector):
    def __init__(self, status: StatusPublic) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        s = self.status
        yield from self._queues(s)
        yield from self._mixture(s)
        yield from self._backends(s)
        lease = GaugeMetricFamily("rb_broker_lease_held", "1 while a broker holds the lease")
        lease.add_metric([], float(s.broker.lease_held))
        yield lease
        dead = GaugeMetricFamily("rb_dead_letter_entries", "entries in the dead-letter stream")
        dead.add_metric([], s.dead_letter)
        yield dead

    def _queues(self, s: StatusPublic) -> Iterator[Metric]:
        depth = GaugeMetricFamily("rb_queue_depth", "sessions waiting for admission",
                                  labels=["workload"])
        age = GaugeMetricFamily("rb_oldest_pending_age_seconds",
                                "age of the oldest session waiting for admission",
                                labels=["workload"])
        finished = CounterMetricFamily("rb_finished_sessions", "results published",
                                       labels=["workload"])
        consumed = CounterMetricFamily("rb_consumed_sessions", "results the trainer acknowledged",
                                       labels=["workload"])
        seconds = HistogramMetricFamily(
            "rb_session_latency_seconds", "enqueue to result published, per session (no _sum: "
            "use histogram_quantile)", labels=["workload"])
        for w in s.workloads:
            seconds.add_metric([w.workload], [
                ("+Inf" if le == float("inf") else repr(le), n)
                for le, n in latency.cumulative_at_powers_of_two(w.latency_buckets_total)],
                sum_value=None)
            depth.add_metric([w.workload], w.depth)
            if w.oldest_pending_age_s is not None:
                age.add_metric([w.workload], w.oldest_pending_age_s)
            finished.add_metric([w.workload], w.finished_total)
            consumed.add_metric([w.workload], w.consumed_total)
        yield from (depth, age, finished, consumed, seconds)

    def _mixture(self, s: StatusPublic) -> Iterator[Metric]:
        target = GaugeMetricFamily("rb_mixture_target", "target share pi_w", labels=["workload"])
        for w, p in sorted(s.mixture.target.items()):
            target.add_metric([w], p)
        yield target
        drift = GaugeMetricFamily("rb_mixture_drift", "1/2*sum|consumed share - target|",
                                  labels=["window"])
        if s.mixture.drift_total is not None:
            drift.add_metric(["total"], s.mixture.drift_total)
        if s.mixture.drift_window is not None:
            drift.add_metric(["recent"], s.mixture.drift_window)
        yield drift

    def _backends(self, s: StatusPublic) -> Iterator[Metric]:
        healthy = GaugeMetricFamily("rb_backend_healthy", "1 while the heartbeat key exists",
                                    labels=["backend"])
        reserved = GaugeMetricFamily("rb_backend_reserved_tokens", "KV tokens reserved",
                                     labels=["backend", "workload"])
        admitted = CounterMetricFamily("rb_backend_admissions", "sessions admitted to the backend",
                                       labels=["backend"])
        preempt = CounterMetricFamily("rb_backend_preemptions", "engine preemptions",
                                      labels=["backend"])
        queries = CounterMetricFamily("rb_backend_prefix_cache_queries",
                                      "prompt tokens looked up in the engine's prefix cache",
                                      labels=["backend"])
        hits = CounterMetricFamily("rb_backend_prefix_cache_hits",
                                   "prompt tokens served from the engine's prefix cache",
                                   labels=["backend"])
        gauges = {f: GaugeMetricFamily(f"rb_backend_{name}", doc, labels=["backend"])
                  for name, f, doc in _BACKEND_GAUGES}
        for b in s.backends:
            healthy.add_metric([b.backend_id], float(b.healthy))
            for w, v in sorted(b.reserved_by_workload.items()):
                reserved.add_metric([b.backend_id, w], v)
            if b.admitted_total is not None:
                admitted.add_metric([b.backend_id], b.admitted_total)
            if b.preemptions_total is not None:
                preempt.add_metric([b.backend_id], b.preemptions_total)
            if b.prefix_cache_queries_total is not None:
                queries.add_metric([b.backend_id], b.prefix_cache_queries_total)
                hits.add_metric([b.backend_id], b.prefix_cache_hits_total or 0)
            for f, g in gauges.items():
                v = getattr(b, f)
                if v is not None:
                    g.add_metric([b.backend_id], float(v))
        yield from (healthy, reserved, admitted, preempt, queries, hits, *gauges.values())


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
                             "description": "Prometheus text exposition"}})
async def metrics(request: Request, reader: StatusReaderDep) -> Response:
    state = request.app.state
    up = 1.0
    try:
        state.last_status = (await reader.read(), time.time())
    except RedisError as exc:  # an outage (or a failing Redis): say so, with what was known
        state.redis_outage.failed(exc)
        up = 0.0
    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    redis_up = GaugeMetricFamily("rb_redis_up", "1 when this scrape read the status from Redis")
    redis_up.add_metric([], up)
    families = [redis_up]
    if state.last_status is not None:
        status, read_at = state.last_status
        registry.register(StatusCollector(status))
        age = GaugeMetricFamily("rb_status_age_seconds",
                                "seconds since the rb_* figures were read from Redis")
        age.add_metric([], max(0.0, time.time() - read_at))
        families.append(age)
    registry.register(_Fixed(families))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


class _Fixed(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families
