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

from broker.heartbeat import HeartbeatRecord, parse_heartbeat
from broker.keys import BROKER_GROUP, Keys
from broker.ledger import LedgerState, parse_ledger
from broker.policies.base import (
    BackendView,
    Completion,
    PendingItem,
    ResidentSession,
    Snapshot,
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


def read_fleet(client: redis.Redis, keys: Keys, backend_ids: Sequence[str],
               results_after: str | None = None, ack_events: Sequence[bytes] = ()) -> FleetRead:
    """One round trip: the index sets, mixture, consumed, each listed backend's ledger and
    heartbeat, new results (if `results_after`), and the broker's ack of the events it woke on.
    A caller whose `backend_ids` differ from the returned `backend_index` reads again."""
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
            beats[b] = parse_heartbeat(hb)
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
                 meta: Mapping[str, ResidentMeta]) -> BackendView:
    progress = hb.progress_by_session() if hb is not None else {}
    sessions = []
    for sid, reserved in ledger.sessions.items():
        m = meta.get(sid)
        if m is None:  # admitted after our read of its metadata; next round sees it
            continue
        p = progress.get(sid)
        sessions.append(ResidentSession(
            session_id=sid, workload=m.workload, group_id=m.group_id, reserved_tokens=reserved,
            prompt_tokens=m.prompt_tokens,
            context_tokens=p.context_tokens if p else m.prompt_tokens,
            generated_tokens=p.generated_tokens if p else 0,
            turn=p.turn if p else 0, max_tokens=m.max_tokens, max_turns=m.max_turns,
            waiting_on_tool=p.waiting_on_tool if p else False, admitted_at=m.admitted_at,
        ))
    return BackendView(
        backend_id=ledger.backend_id, capacity_tokens=ledger.capacity_tokens,
        max_model_len=ledger.max_model_len, healthy=hb is not None, alpha=ledger.alpha,
        telemetry=hb.telemetry() if hb is not None else None, sessions=tuple(sessions),
    )


def build_snapshot(now: float, pending: Mapping[str, Sequence[PendingItem]], fleet: FleetRead,
                   meta: Mapping[str, ResidentMeta],
                   completions: Sequence[Completion] = ()) -> Snapshot:
    return Snapshot(
        now=now,
        pending={w: tuple(items) for w, items in pending.items() if items},
        backends=tuple(backend_view(fleet.ledgers[b], fleet.heartbeats.get(b), meta)
                       for b in sorted(fleet.ledgers)),
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
