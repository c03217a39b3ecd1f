"""Read the namespace's status in two pipelined round trips, without scanning any queue.

Queue depths are XLEN; the oldest pending age is the first entry of each stream (an entry id is
its enqueue time in ms; a requeued entry carries `enqueued_at`); per backend one HGETALL of the
ledger, one HLEN of its sessions, one GET of its heartbeat and one XINFO STREAM of its admitted
stream (for `entries-added`). Cost grows with backends and workloads, not with sessions.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from api.history import CounterHistory, Sample
from api.models import (
    BackendStatus,
    BrokerStatus,
    MixtureStatus,
    StatusPublic,
    ThroughputWindow,
    WorkloadStatus,
)
from broker.heartbeat import parse_heartbeat
from broker.keys import Keys
from broker.ledger import parse_ledger


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _ints(raw: Mapping) -> dict[str, int]:
    return {_text(k): int(v) for k, v in raw.items()}


def _valid(key_of, names) -> list[str]:
    """The index members a key can be built for; a hand-written bad name is skipped, not a 500."""
    out = []
    for n in sorted(_text(v) for v in names):
        try:
            key_of(n)
        except ValueError:
            continue
        out.append(n)
    return out


def drift(consumed: Mapping[str, int], target: Mapping[str, float]) -> float | None:
    """½·Σ_w |consumed share − π_w|; None with no target or nothing consumed."""
    total = sum(consumed.values())
    if total <= 0 or not target:
        return None
    names = set(consumed) | set(target)
    return 0.5 * sum(abs(consumed.get(w, 0) / total - target.get(w, 0.0)) for w in names)


def _first_age(entries: list, now: float, requeued: bool) -> float | None:
    if not entries:
        return None
    entry_id, fields = entries[0]
    stamp = fields.get(b"enqueued_at") if requeued else None
    try:
        t = float(stamp) if stamp is not None else int(_text(entry_id).split("-")[0]) / 1000.0
    except ValueError:
        return None
    return max(0.0, now - t)


def _backend(b: str, fields: dict, n_sessions: int, hb_raw, info, now: float) -> BackendStatus | None:
    led = parse_ledger(b, fields, {})
    if led is None:
        return None
    hb = parse_heartbeat(hb_raw)
    m = hb.metrics if hb else None
    admitted = None
    if isinstance(info, dict):
        added = info.get("entries-added", info.get(b"entries-added"))
        admitted = int(added) if added is not None else None
    return BackendStatus(
        backend_id=b, healthy=hb is not None, capacity_tokens=led.capacity_tokens,
        max_model_len=led.max_model_len, alpha=led.alpha, limit_tokens=led.limit_tokens,
        reserved_tokens=led.reserved_tokens, reserved_by_workload=led.reserved_by_workload,
        sessions=int(n_sessions), admitted_total=admitted,
        kv_usage=m.kv_usage if m else None, running=m.running if m else None,
        waiting=m.waiting if m else None, preemptions_total=m.preemptions_total if m else None,
        prefix_hit_rate=(m.prefix_hits_total / m.prefix_queries_total
                         if m and m.prefix_queries_total else None),
        heartbeat_age_s=max(0.0, now - hb.at) if hb else None,
    )


async def read_status(client: aioredis.Redis, keys: Keys, history: CounterHistory,
                      mixture_window_s: float, throughput_windows_s: tuple[float, ...]) -> StatusPublic:
    pipe = client.pipeline(transaction=False)
    pipe.smembers(keys.workloads)
    pipe.smembers(keys.backends)
    pipe.hgetall(keys.mixture)
    pipe.hgetall(keys.consumed)
    pipe.hgetall(keys.kv_seconds)
    pipe.exists(keys.lease)
    pipe.xlen(keys.results)
    pipe.xlen(keys.dead_letter)
    wl_raw, be_raw, mix_raw, cons_raw, kvsec_raw, lease, n_results, n_dead = await pipe.execute()
    workloads = _valid(keys.pending, wl_raw)
    backends = _valid(keys.ledger, be_raw)

    pipe = client.pipeline(transaction=False)
    for w in workloads:
        pipe.xlen(keys.pending(w))
        pipe.xlen(keys.requeue(w))
        pipe.xrange(keys.pending(w), count=1)
        pipe.xrange(keys.requeue(w), count=1)
    for b in backends:
        pipe.hgetall(keys.ledger(b))
        pipe.hlen(keys.ledger_sessions(b))
        pipe.get(keys.heartbeat(b))
        pipe.xinfo_stream(keys.admitted(b))
    replies = await pipe.execute(raise_on_error=False)
    for r in replies:  # a missing admitted stream (reclaimed backend) is expected; nothing else
        if isinstance(r, Exception) and not (isinstance(r, ResponseError) and "no such key" in str(r)):
            raise r
    now = time.time()

    target = {_text(k): float(v) for k, v in mix_raw.items()}
    consumed = _ints(cons_raw)
    kvsec = {_text(k): v for k, v in kvsec_raw.items()}
    finished = {k[2:]: int(v) for k, v in kvsec.items() if k.startswith("n:")}
    sample = Sample(at=now, finished=finished, consumed=consumed)

    wl_status = []
    for i, w in enumerate(workloads):
        n_pend, n_req, first_pend, first_req = replies[4 * i: 4 * i + 4]
        ages = [a for a in (_first_age(first_pend, now, False), _first_age(first_req, now, True))
                if a is not None]
        wl_status.append(WorkloadStatus(
            workload=w, depth=int(n_pend) + int(n_req), requeued=int(n_req),
            oldest_pending_age_s=max(ages) if ages else None,
            finished_total=finished.get(w, 0), consumed_total=consumed.get(w, 0)))

    off = 4 * len(workloads)
    be_status = []
    for j, b in enumerate(backends):
        fields, n_sessions, hb_raw, info = replies[off + 4 * j: off + 4 * j + 4]
        st = _backend(b, fields, n_sessions, hb_raw, info, now)
        if st is not None:
            be_status.append(st)

    win = history.delta(sample, mixture_window_s)
    throughput = []
    for span in throughput_windows_s:
        d = history.delta(sample, span)
        rate = {w: (n / d.span_s if d.span_s > 0 else 0.0) for w, n in d.finished.items()}
        throughput.append(ThroughputWindow(window_s=span, covered_s=d.span_s,
                                           sessions_per_s=sum(rate.values()), by_workload=rate))
    history.add(sample)

    return StatusPublic(
        at=now, namespace=keys.namespace, broker=BrokerStatus(lease_held=bool(lease)),
        workloads=wl_status, backends=be_status,
        mixture=MixtureStatus(target=target, consumed_total=consumed,
                              consumed_window=win.consumed, window_s=win.span_s,
                              drift_total=drift(consumed, target),
                              drift_window=drift(win.consumed, target)),
        throughput=throughput, results_total=int(n_results), dead_letter=int(n_dead),
    )
