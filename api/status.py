"""Read the namespace's status in one round trip, without scanning any queue.

One call of `lua/status.lua` with every key it reads declared (the workloads and backends
known from the last call; it returns the index sets, and a changed index means a second call):
per workload XLEN and the first entry of each stream (an entry id is its enqueue time
in ms; a requeued entry carries `enqueued_at`); per backend the ledger hash, HLEN of its
sessions, the heartbeat's metrics (decoded in Redis, so the per-session progress never travels)
and the admitted stream's `entries-added`. Cost grows with backends and workloads, not sessions.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from importlib import resources

import redis.asyncio as aioredis
from pydantic import ValidationError

from api.history import ChartSample, ChartTrail, CounterHistory, Sample
from api.models import (
    BackendStatus,
    BrokerStatus,
    LatencyStatus,
    MixtureStatus,
    StatusPublic,
    ThroughputWindow,
    WorkloadStatus,
)
from broker import latency
from broker.heartbeat import EngineMetrics, SharedPart
from broker.keys import Keys
from broker.ledger import parse_ledger
from broker.mixture import mixture_drift
from broker.streams import as_text

STATUS_LUA = resources.files("api").joinpath("lua", "status.lua").read_text(encoding="utf-8")


def _pairs(flat: list | dict) -> dict[str, str]:
    """A Lua HGETALL reply after cjson: a flat [field, value, ...] list ({} when empty)."""
    if not isinstance(flat, list):
        return {}
    return {str(flat[i]): str(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}


def _valid(key_of, names) -> list[str]:
    """The index members a key can be built for; a hand-written bad name is skipped, not a 500."""
    out = []
    for n in sorted(as_text(v) for v in names):
        try:
            key_of(n)
        except ValueError:
            continue
        out.append(n)
    return out


def drift(consumed: Mapping[str, int], target: Mapping[str, float]) -> float | None:
    """`mixture_drift`, or None with no target or nothing consumed."""
    if sum(consumed.values()) <= 0 or not target:
        return None
    return mixture_drift(consumed, target)


def _age(stamp: str, now: float) -> float | None:
    """Seconds since a stream entry id ("<ms>-<seq>") or a unix time in seconds."""
    if not stamp:
        return None
    try:
        t = int(stamp.split("-")[0]) / 1000.0 if "-" in stamp else float(stamp)
    except ValueError:
        return None
    return max(0.0, now - t)


def _backend(b: str, ledger_flat, n_sessions: int, metrics, added: int,
             now: float) -> BackendStatus | None:
    led = parse_ledger(b, _pairs(ledger_flat), {})
    if led is None:
        return None
    m = at = part = None
    if isinstance(metrics, dict):
        at = metrics.pop("at", None)
        raw_part = metrics.pop("shared", None)  # (on an engine namespaces share)
        try:
            part = SharedPart.model_validate(raw_part) if raw_part is not None else None
        except ValidationError:
            part = None
        try:
            m = EngineMetrics.model_validate(metrics)
        except ValidationError:  # an unreadable beat is no health (as parse_heartbeat says)
            m = None
    return BackendStatus(
        backend_id=b, healthy=m is not None, capacity_tokens=led.capacity_tokens,
        max_model_len=led.max_model_len, alpha=led.alpha, limit_tokens=led.limit_tokens,
        reserved_tokens=led.reserved_tokens, reserved_by_workload=led.reserved_by_workload,
        sessions=int(n_sessions), admitted_total=int(added) if added >= 0 else None,
        kv_usage=m.kv_usage if m else None, running=m.running if m else None,
        waiting=m.waiting if m else None, preemptions_total=m.preemptions_total if m else None,
        prefix_hit_rate=(m.prefix_hits_total / m.prefix_queries_total
                         if m and m.prefix_queries_total else None),
        prefix_cache_queries_total=m.prefix_queries_total if m else None,
        prefix_cache_hits_total=m.prefix_hits_total if m else None,
        heartbeat_age_s=max(0.0, now - float(at)) if m and isinstance(at, int | float) else None,
        share=part.share if m and part else None,
        part_tokens=part.capacity_tokens if m and part else None,
    )


def _counter(fields: dict[str, str], prefix: str) -> dict[str, int]:
    """workload -> count, from the kvsec hash's `<prefix><workload>` fields (finish.lua)."""
    return {f[len(prefix):]: int(v) for f, v in fields.items() if f.startswith(prefix)}


def _latency(buckets: dict[int, int], span_s: float) -> LatencyStatus | None:
    q = latency.quantiles(buckets, (0.5, 0.95, 0.99))
    if q is None:
        return None
    return LatencyStatus(window_s=span_s, finished=sum(buckets.values()),
                         p50_s=q[0], p95_s=q[1], p99_s=q[2])


def _broker(lease: object) -> BrokerStatus:
    """Who holds the lease: a broker's token is "<policy>@<consumer>/<nonce>" (lease.py)."""
    token = lease if isinstance(lease, str) else ""
    holder, sep, _ = token.rpartition("/")
    policy, at, consumer = holder.rpartition("@") if sep else ("", "", "")
    return BrokerStatus(lease_held=bool(token), policy=policy if at else None,
                        holder=consumer if at else None)


def chart_sample(st: StatusPublic) -> ChartSample:
    drift = {k: v for k, v in (("recent", st.mixture.drift_window),
                               ("total", st.mixture.drift_total)) if v is not None}
    return ChartSample(at=st.at, queue={w.workload: w.depth for w in st.workloads},
                       kv={b.backend_id: b.kv_usage for b in st.backends if b.kv_usage is not None},
                       drift=drift)


class StatusReader:
    """Reads `StatusPublic` for one namespace; holds the client and the registered script."""

    def __init__(self, client: aioredis.Redis, keys: Keys, history: CounterHistory,
                 mixture_window_s: float, throughput_windows_s: tuple[float, ...]) -> None:
        self._client = client
        self._keys = keys
        self._history = history
        self._script = client.register_script(STATUS_LUA)
        self.mixture_window_s = mixture_window_s
        self.throughput_windows_s = throughput_windows_s
        self.trail: ChartTrail | None = None  # the dashboard's history, fed by every read
        self._workloads: list[str] = []  # the index as of the last read
        self._backends: list[str] = []

    async def read(self) -> StatusPublic:
        """One script call while the fleet's index is unchanged; a second when it changed."""
        for _ in range(3):
            raw = await self._call(self._workloads, self._backends)
            workloads = _valid(self._keys.pending, raw["index_workloads"] or [])
            backends = _valid(self._keys.ledger, raw["index_backends"] or [])
            if (workloads, backends) == (self._workloads, self._backends):
                break
            self._workloads, self._backends = workloads, backends
        else:  # the index kept changing under us: answer with the last names we read with
            workloads, backends = self._workloads, self._backends
            raw = await self._call(workloads, backends)
        return self._build(raw, workloads, backends, time.time())

    async def _call(self, workloads: list[str], backends: list[str]) -> dict:
        k = self._keys
        keys = [k.mixture, k.consumed, k.kv_seconds, k.lease, k.results, k.dead_letter,
                k.workloads, k.backends]
        for w in workloads:
            keys += [k.pending(w), k.requeue(w)]
        for b in backends:
            keys += [k.ledger(b), k.ledger_sessions(b), k.heartbeat(b), k.admitted(b)]
        return json.loads(await self._script(keys=keys, args=[len(workloads), len(backends)]))

    def _build(self, raw: dict, workloads: list[str], backends: list[str],
               now: float) -> StatusPublic:
        target = {w: float(v) for w, v in _pairs(raw["mixture"]).items()}
        consumed = {w: int(v) for w, v in _pairs(raw["consumed"]).items()}
        counters = _pairs(raw["kvsec"])
        finished = _counter(counters, "n:")
        failed = _counter(counters, "failed:")
        sample = Sample(at=now, finished=finished, consumed=consumed,
                        tokens=_counter(counters, "tok:"), latency=latency.parse_counters(counters))
        win = self._history.delta(sample, self.mixture_window_s)
        latency_buckets = latency.by_workload(win.latency)
        latency_totals = latency.by_workload(sample.latency)

        wl_status = []
        for w, (n_pend, n_req, first_pend, first_req) in zip(workloads, raw["workloads"] or []):
            ages = [a for a in (_age(str(first_pend), now), _age(str(first_req), now))
                    if a is not None]
            wl_status.append(WorkloadStatus(
                workload=w, depth=int(n_pend) + int(n_req), requeued=int(n_req),
                oldest_pending_age_s=max(ages) if ages else None,
                finished_total=finished.get(w, 0), failed_total=failed.get(w, 0),
                consumed_total=consumed.get(w, 0),
                latency=_latency(latency_buckets.get(w, {}), win.span_s),
                latency_buckets_total=latency_totals.get(w, {})))
        be_status = [st for b, row in zip(backends, raw["backends"] or [])
                     if (st := _backend(b, *row, now=now)) is not None]

        throughput = []
        for span in self.throughput_windows_s:
            d = self._history.delta(sample, span)
            rate = {w: (n / d.span_s if d.span_s > 0 else 0.0) for w, n in d.finished.items()}
            tok = {w: (n / d.span_s if d.span_s > 0 else 0.0) for w, n in d.tokens.items()}
            throughput.append(ThroughputWindow(window_s=span, covered_s=d.span_s,
                                               sessions_per_s=sum(rate.values()),
                                               by_workload=rate, tokens_per_s=sum(tok.values()),
                                               tokens_by_workload=tok))
        self._history.add(sample)
        status = StatusPublic(
            at=now, namespace=self._keys.namespace,
            broker=_broker(raw["lease"]),
            workloads=wl_status, backends=be_status,
            mixture=MixtureStatus(target=target, consumed_total=consumed,
                                  consumed_window=win.consumed, window_s=win.span_s,
                                  drift_total=drift(consumed, target),
                                  drift_window=drift(win.consumed, target)),
            throughput=throughput, results_unacknowledged=int(raw["results"]),
            dead_letter=int(raw["dead"]),
        )
        if self.trail is not None:
            self.trail.add(chart_sample(status))
        return status
