"""Redis → policy `Snapshot`: read the fleet in one round trip, then build frozen views.

Reading (`read_fleet`) is the only I/O here; `build_snapshot` is pure so it is tested and timed
without Redis. Pending items come from the broker's own buffer (entries it has read from the
streams and holds in its consumer-group backlog), oldest first, requeued ones in front.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import redis

from broker.heartbeat import HeartbeatRecord, SessionProgress, parse_heartbeat
from broker.keys import BROKER_GROUP, Keys
from broker.ledger import LedgerState, parse_ledger
from broker.policies.base import (
    BackendView,
    Completion,
    PendingItem,
    ResidentSession,
    Snapshot,
    Telemetry,
)
from broker.session import Session, SessionResult
from broker.streams import as_text
from broker.weights import NOT_UPDATED, WeightsState


@dataclass(frozen=True, slots=True)
class FleetRead:
    """Everything the broker reads from Redis for one decision, as of one MULTI."""

    backend_index: tuple[str, ...]  # the backends set now; ledgers cover the ids asked for
    workloads: tuple[str, ...]
    ledgers: Mapping[str, LedgerState]
    heartbeats: Mapping[str, HeartbeatRecord | None]
    mixture: Mapping[str, float]
    consumed: Mapping[str, int]
    results: tuple[tuple[str, Mapping], ...] = ()  # results-stream entries after `results_after`
    weights: WeightsState = NOT_UPDATED  # pause, version served and staleness bound


class ViewCache:
    """What the previous snapshot built, for the next one to reuse (the broker holds one):
    a heartbeat whose stored bytes did not change is not parsed again, and a resident
    session whose charge, progress and metadata did not change keeps its `ResidentSession`.
    With hundreds of backends and tens of thousands of residents, building those anew on
    every loop was most of the broker's time."""

    def __init__(self) -> None:
        self._beats: dict[str, _Beat] = {}
        self._sessions: dict[str, ResidentSession] = {}
        self._tuples: dict[str, tuple[ResidentSession, ...]] = {}  # per backend, last built

    def heartbeat(self, backend_id: str, raw: bytes | None) -> HeartbeatRecord | None:
        hit = self._beats.get(backend_id)
        if hit is not None and raw is not None and hit.raw == raw:
            return hit.record
        record = parse_heartbeat(raw)
        if record is None:
            self._beats.pop(backend_id, None)
        else:
            self._beats[backend_id] = _Beat(raw, record, record.progress_by_session(),
                                            record.telemetry())
        return record

    def beat(self, backend_id: str, record: HeartbeatRecord) -> _Beat:
        hit = self._beats.get(backend_id)
        if hit is None or hit.record is not record:
            hit = _Beat(None, record, record.progress_by_session(), record.telemetry())
            self._beats[backend_id] = hit
        return hit

    def keep_backends(self, backend_ids: Sequence[str]) -> None:
        for b in set(self._beats) - set(backend_ids):
            del self._beats[b]
        for b in set(self._tuples) - set(backend_ids):
            del self._tuples[b]


@dataclass(frozen=True, slots=True)
class _Beat:
    raw: bytes | None
    record: HeartbeatRecord
    progress: Mapping[str, SessionProgress]
    telemetry: Telemetry


def read_fleet(client: redis.Redis, keys: Keys, backend_ids: Sequence[str],
               results_after: str | None = None, ack_events: Sequence[bytes] = (),
               cache: ViewCache | None = None) -> FleetRead:
    """One round trip: the index sets, mixture, consumed, each listed backend's ledger and
    heartbeat, new results (if `results_after`), and the broker's ack of the events it woke on.
    A caller whose `backend_ids` differ from the returned `backend_index` reads again. With a
    `cache`, unchanged heartbeats are not parsed again."""
    pipe = client.pipeline(transaction=True)
    pipe.smembers(keys.backends)
    pipe.smembers(keys.workloads)
    pipe.hgetall(keys.mixture)
    pipe.hgetall(keys.consumed)
    pipe.xread({keys.results: results_after or "$"}, count=10000)
    pipe.hgetall(keys.weights)
    if ack_events:
        pipe.xack(keys.events, BROKER_GROUP, *ack_events)
        pipe.xdel(keys.events, *ack_events)
    for b in backend_ids:
        pipe.hgetall(keys.ledger(b))
        pipe.hgetall(keys.ledger_sessions(b))
        pipe.get(keys.heartbeat(b))
    replies = pipe.execute()
    index, workloads, mixture, consumed, results, weights = replies[:6]
    per_backend = replies[8:] if ack_events else replies[6:]
    ledgers: dict[str, LedgerState] = {}
    beats: dict[str, HeartbeatRecord | None] = {}
    for i, b in enumerate(backend_ids):
        fields, sessions, hb = per_backend[3 * i: 3 * i + 3]
        state = parse_ledger(b, fields, sessions)
        if state is not None:
            ledgers[b] = state
            beats[b] = cache.heartbeat(b, hb) if cache is not None else parse_heartbeat(hb)
    if cache is not None:
        cache.keep_backends(list(ledgers))
    entries = tuple((as_text(eid), f) for _, es in (results or []) for eid, f in es) \
        if results_after else ()
    return FleetRead(
        backend_index=tuple(sorted(as_text(b) for b in index)),
        workloads=tuple(sorted(as_text(w) for w in workloads)),
        ledgers=ledgers,
        heartbeats=beats,
        mixture={as_text(k): float(v) for k, v in mixture.items()},
        consumed={as_text(k): int(v) for k, v in consumed.items()},
        results=entries,
        weights=WeightsState.from_hash(weights),
    )


def pending_item(session: Session, enqueued_at: float) -> PendingItem:
    """A new session as the policy sees it; the prefix is token ids, or UTF-8 bytes of text.
    A session that resumes part-way (`resume_from`) is seen as new, from the context it goes
    on from (its turn count stays the whole session's, as its heartbeats report turns)."""
    if session.resume_from is not None:
        prefix = tuple(session.resume_from.history_token_ids)
    elif session.prompt_token_ids is not None:
        prefix = tuple(session.prompt_token_ids)
    else:
        prefix = tuple((session.prompt_text or "").encode("utf-8"))
    return PendingItem(
        session_id=session.session_id, workload=session.workload, group_id=session.group_id,
        group_size=session.group_size, prompt_tokens=session.prompt_len_hint, prefix=prefix,
        max_tokens=session.max_tokens, max_turns=session.max_turns, turn=0, home_backend=None,
        enqueued_at=enqueued_at,
    )


@dataclass(frozen=True, slots=True)
class ResidentMeta:
    """What the broker remembers of an admitted session (from admission or its state hash)."""

    workload: str
    group_id: str | None
    prompt_tokens: int
    max_tokens: int
    max_turns: int
    admitted_at: float


def resident_meta(session: Session, admitted_at: float) -> ResidentMeta:
    return ResidentMeta(workload=session.workload, group_id=session.group_id,
                        prompt_tokens=session.prompt_len_hint, max_tokens=session.max_tokens,
                        max_turns=session.max_turns, admitted_at=admitted_at)


def backend_view(ledger: LedgerState, hb: HeartbeatRecord | None,
                 meta: Mapping[str, ResidentMeta], cache: ViewCache | None = None,
                 kept: dict[str, ResidentSession] | None = None) -> BackendView:
    """The policy's view of one backend. With a `cache`, a resident session is rebuilt only
    when its charge, progress or metadata changed; the sessions seen go into `kept`."""
    if hb is None:
        progress: Mapping[str, SessionProgress] = {}
        telemetry = None
    elif cache is not None:
        beat = cache.beat(ledger.backend_id, hb)
        progress, telemetry = beat.progress, beat.telemetry
    else:
        progress, telemetry = hb.progress_by_session(), hb.telemetry()
    before = cache._sessions if cache is not None else {}
    sessions = []
    reused = True
    for sid, reserved in ledger.sessions.items():
        m = meta.get(sid)
        if m is None:  # admitted after our read of its metadata; next round sees it
            continue
        p = progress.get(sid)
        if p is None:
            context, generated, turn, parked = m.prompt_tokens, 0, 0, False
        else:
            context, generated, turn, parked = (p.context_tokens, p.generated_tokens, p.turn,
                                                p.waiting_on_tool)
        s = before.get(sid)
        if (s is None or s.reserved_tokens != reserved or s.context_tokens != context
                or s.generated_tokens != generated or s.turn != turn
                or s.waiting_on_tool != parked or s.admitted_at != m.admitted_at
                or s.workload != m.workload):
            s = ResidentSession(
                session_id=sid, workload=m.workload, group_id=m.group_id,
                reserved_tokens=reserved, prompt_tokens=m.prompt_tokens,
                context_tokens=context, generated_tokens=generated, turn=turn,
                max_tokens=m.max_tokens, max_turns=m.max_turns, waiting_on_tool=parked,
                admitted_at=m.admitted_at,
            )
            reused = False
        if kept is not None:
            kept[sid] = s
        sessions.append(s)
    resident = tuple(sessions)
    if cache is not None:
        # Every session as before, in the same order: the very same tuple, so a policy can
        # tell an unchanged backend by identity (MisaT keeps its sums per backend that way).
        last = cache._tuples.get(ledger.backend_id)
        if reused and last is not None and last == resident:
            resident = last
        cache._tuples[ledger.backend_id] = resident
    return BackendView(
        backend_id=ledger.backend_id, capacity_tokens=ledger.capacity_tokens,
        max_model_len=ledger.max_model_len, healthy=hb is not None, alpha=ledger.alpha,
        telemetry=telemetry, sessions=resident,
    )


def build_snapshot(now: float, pending: Mapping[str, Sequence[PendingItem]], fleet: FleetRead,
                   meta: Mapping[str, ResidentMeta],
                   completions: Sequence[Completion] = (),
                   cache: ViewCache | None = None) -> Snapshot:
    """The policy's snapshot. The same with or without `cache` (which only saves rebuilding
    what did not change since the snapshot it last built)."""
    kept: dict[str, ResidentSession] | None = {} if cache is not None else None
    backends = tuple(backend_view(fleet.ledgers[b], fleet.heartbeats.get(b), meta, cache, kept)
                     for b in sorted(fleet.ledgers))
    if cache is not None and kept is not None:
        cache._sessions = kept
    return Snapshot(
        now=now,
        pending={w: tuple(items) for w, items in pending.items() if items},
        backends=backends,
        mixture_target=dict(fleet.mixture),
        consumed=dict(fleet.consumed),
        new_completions=tuple(completions),
    )


def completion_from_entry(fields: Mapping) -> Completion | None:
    """A results-stream entry as a policy `Completion`; None if it cannot be read."""
    f = {as_text(k): v for k, v in fields.items()}
    try:
        r = SessionResult.model_validate_json(f["result"])
        stats = json.loads(f.get("stats") or "{}")
    except (KeyError, ValueError):
        return None
    turns = stats.get("turn_output_tokens") or ([r.output_tokens] if r.turns <= 1 else [])
    return Completion(
        session_id=r.session_id, workload=r.workload, backend_id=r.backend_id or "",
        prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens,
        turn_output_tokens=tuple(int(t) for t in turns), turns=r.turns,
        tool_wait_s=float(stats.get("tool_wait_s", 0.0)),
        kv_token_seconds=float(stats.get("kv_token_seconds", 0.0)),
        admitted_at=r.admitted_at or 0.0, finished_at=r.finished_at or 0.0,
        truncated=bool(stats.get("truncated", False)),
    )
