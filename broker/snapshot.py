"""Redis → policy `Snapshot`: read the fleet in one round trip, then build frozen views.

Reading (`read_fleet`) is the only I/O here; `build_snapshot` is pure so it is tested and timed
without Redis. Pending items come from the broker's own buffer (entries it has read from the
streams and holds in its consumer-group backlog), oldest first, requeued ones in front.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import redis

from broker.heartbeat import HeartbeatRecord, SessionProgress, admits, parse_heartbeat
from broker.keys import BROKER_GROUP, Keys
from broker.ledger import (EnqueueLimits, LedgerState, ledger_fields, ledger_state,
                           ledger_version, parse_ledger)
from broker.policies.base import (
    BackendView,
    Completion,
    PendingItem,
    ResidentSession,
    Snapshot,
    Telemetry,
)
from broker.session import Session
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
    completions: tuple[tuple[str, Mapping], ...] = ()  # entries after `completions_after`
    weights: WeightsState = NOT_UPDATED  # pause, version served and staleness bound


def live_limits(fleet: FleetRead) -> EnqueueLimits | None:
    """The largest context and KV cache among the live backends (a heartbeat present); None
    when none is live (the fleet is not known)."""
    live = [led for b, led in fleet.ledgers.items() if fleet.heartbeats.get(b) is not None]
    if not live:
        return None
    return EnqueueLimits(max_model_len=max(led.max_model_len for led in live),
                         capacity_tokens=max(led.capacity_tokens for led in live))


class ViewCache:
    """What the previous read and snapshot built, for the next ones to reuse (the broker holds
    one). With hundreds of backends and tens of thousands of residents, reading and building
    all of it anew on every loop was most of the broker's time. Reused:

    - a ledger's sessions, while its version (`ledger.ledger_version`: every script that
      changes the sessions hash bumps it) is the one they were read at: `read_fleet` then
      reads only the small ledger hash;
    - a heartbeat whose stored bytes did not change (not parsed again);
    - a backend's whole view while its ledger version, heartbeat and limits did not change,
      so a policy can tell an unchanged backend by the identity of its sessions tuple
      (MisaT keeps its per-backend sums that way);
    - otherwise each resident session whose charge, progress and metadata did not change.
    """

    def __init__(self) -> None:
        self._ledgers: dict[str, tuple[str, dict[str, int]]] = {}  # version, sessions
        self._beats: dict[str, _Beat] = {}
        self._views: dict[str, _ViewMemo] = {}

    def sessions_at(self, backend_id: str, version: str | None) -> dict[str, int] | None:
        hit = self._ledgers.get(backend_id)
        return hit[1] if hit is not None and version is not None and hit[0] == version else None

    def holds(self, backend_id: str) -> bool:
        return backend_id in self._ledgers

    def store_ledger(self, state: LedgerState) -> None:
        if state.version is None:
            self._ledgers.pop(state.backend_id, None)
        else:
            self._ledgers[state.backend_id] = (state.version, state.sessions)

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

    def keep_backends(self, backend_ids: Iterable[str]) -> None:
        keep = set(backend_ids)
        for memo in (self._ledgers, self._beats, self._views):
            for b in set(memo) - keep:
                del memo[b]


@dataclass(frozen=True, slots=True)
class _Beat:
    raw: bytes | None
    record: HeartbeatRecord
    progress: Mapping[str, SessionProgress]
    telemetry: Telemetry


@dataclass(frozen=True, slots=True)
class _ViewMemo:
    key: tuple  # (ledger version, heartbeat record, alpha, capacity, max_model_len)
    view: BackendView
    complete: bool  # every resident's metadata was known (none left out)
    sessions: Mapping[str, ResidentSession]


def read_fleet(client: redis.Redis, keys: Keys, backend_ids: Sequence[str],
               completions_after: str | None = None, ack_events: Sequence[bytes] = (),
               cache: ViewCache | None = None, expect_changed: Iterable[str] = ()) -> FleetRead:
    """One round trip: the index sets, mixture, consumed, each listed backend's ledger and
    heartbeat, new completions (if `completions_after`), and the broker's ack of the events it
    woke on.
    A caller whose `backend_ids` differ from the returned `backend_index` reads again.

    With a `cache`, a ledger's sessions are read only where the cache does not hold them at
    the ledger's current version: in the same transaction for backends in `expect_changed`
    (the caller's own admissions went there) or not cached, in a second one for the rest that
    changed (each ledger with its sessions, consistent). Unchanged heartbeats are not parsed."""
    expected = set(expect_changed)
    want = set(backend_ids) if cache is None else {
        b for b in backend_ids if b in expected or not cache.holds(b)}
    pipe = client.pipeline(transaction=True)
    pipe.smembers(keys.backends)
    pipe.smembers(keys.workloads)
    pipe.hgetall(keys.mixture)
    pipe.hgetall(keys.consumed)
    pipe.xread({keys.completions: completions_after or "$"}, count=10000)
    pipe.hgetall(keys.weights)
    if ack_events:
        pipe.xack(keys.events, BROKER_GROUP, *ack_events)
        pipe.xdel(keys.events, *ack_events)
    for b in backend_ids:
        pipe.hgetall(keys.ledger(b))
        if b in want:
            pipe.hgetall(keys.ledger_sessions(b))
        pipe.get(keys.heartbeat(b))
    replies = pipe.execute()
    index, workloads, mixture, consumed, completions, weights = replies[:6]
    it = iter(replies[8:] if ack_events else replies[6:])
    ledgers: dict[str, LedgerState] = {}
    beats: dict[str, HeartbeatRecord | None] = {}
    raw_beats: dict[str, bytes | None] = {}
    changed: list[str] = []
    for b in backend_ids:
        fields = next(it)
        sessions = next(it) if b in want else None
        raw_beats[b] = next(it)
        if sessions is not None:
            state = parse_ledger(b, fields, sessions)
            if state is not None:
                ledgers[b] = state
            continue
        f = ledger_fields(fields)
        if f is None:
            continue  # not registered
        known = cache.sessions_at(b, ledger_version(f)) if cache is not None else None
        if known is None:
            changed.append(b)  # not at the cached version: read with its sessions below
        else:
            ledgers[b] = ledger_state(b, f, known)
    if changed:
        again = client.pipeline(transaction=True)
        for b in changed:
            again.hgetall(keys.ledger(b))
            again.hgetall(keys.ledger_sessions(b))
        replies = again.execute()
        for i, b in enumerate(changed):
            state = parse_ledger(b, replies[2 * i], replies[2 * i + 1])
            if state is not None:
                ledgers[b] = state
    for b in backend_ids:
        if b in ledgers:
            if cache is not None:
                if b in want or b in changed:
                    cache.store_ledger(ledgers[b])
                beats[b] = cache.heartbeat(b, raw_beats[b])
            else:
                beats[b] = parse_heartbeat(raw_beats[b])
    if cache is not None:
        cache.keep_backends(ledgers)
    entries = tuple((as_text(eid), f) for _, es in (completions or []) for eid, f in es) \
        if completions_after else ()
    return FleetRead(
        backend_index=tuple(sorted(as_text(b) for b in index)),
        workloads=tuple(sorted(as_text(w) for w in workloads)),
        ledgers=ledgers,
        heartbeats=beats,
        mixture={as_text(k): float(v) for k, v in mixture.items()},
        consumed={as_text(k): int(v) for k, v in consumed.items()},
        completions=entries,
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
        enqueued_at=enqueued_at, model=session.model, adapter=session.adapter,
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
    adapter: str | None = None


def resident_meta(session: Session, admitted_at: float) -> ResidentMeta:
    return ResidentMeta(workload=session.workload, group_id=session.group_id,
                        prompt_tokens=session.prompt_len_hint, max_tokens=session.max_tokens,
                        max_turns=session.max_turns, admitted_at=admitted_at,
                        adapter=session.adapter)


def planned_capacity(ledger: LedgerState, hb: HeartbeatRecord | None) -> int:
    """The KV tokens a backend's admissions are planned against: its engine's capacity, or on
    an engine several namespaces share, this namespace's part of it now (broker/shares.py)."""
    return hb.shared.capacity_tokens if hb is not None and hb.shared is not None \
        else ledger.capacity_tokens


def backend_view(ledger: LedgerState, hb: HeartbeatRecord | None,
                 meta: Mapping[str, ResidentMeta], cache: ViewCache | None = None) -> BackendView:
    """The policy's view of one backend (see `ViewCache` for what a `cache` reuses)."""
    key: tuple = ()
    memo = None
    if cache is not None:
        key = (ledger.version, hb, ledger.alpha, ledger.capacity_tokens, ledger.max_model_len,
               ledger.model, ledger.max_loras)
        memo = cache._views.get(ledger.backend_id)
        if (memo is not None and memo.complete and ledger.version is not None
                and memo.key[0] == key[0] and memo.key[1] is hb and memo.key[2:] == key[2:]):
            return memo.view
    if hb is None:
        progress: Mapping[str, SessionProgress] = {}
        telemetry = None
    elif cache is not None:
        beat = cache.beat(ledger.backend_id, hb)
        progress, telemetry = beat.progress, beat.telemetry
    else:
        progress, telemetry = hb.progress_by_session(), hb.telemetry()
    before = memo.sessions if memo is not None else {}
    sessions: dict[str, ResidentSession] = {}
    complete = True
    for sid, reserved in ledger.sessions.items():
        m = meta.get(sid)
        if m is None:  # admitted after our read of its metadata; next round sees it
            complete = False
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
                admitted_at=m.admitted_at, adapter=m.adapter,
            )
        sessions[sid] = s
    resident = tuple(sessions.values())
    if memo is not None and memo.view.sessions == resident:
        # Every session as before, in the same order: the very same tuple, so a policy can
        # tell an unchanged backend by identity (MisaT keeps its sums per backend that way).
        resident = memo.view.sessions
    shared = hb.shared if hb is not None else None
    view = BackendView(
        backend_id=ledger.backend_id, capacity_tokens=planned_capacity(ledger, hb),
        max_model_len=ledger.max_model_len, healthy=admits(hb), alpha=ledger.alpha,
        telemetry=telemetry, sessions=resident, model=ledger.model,
        max_loras=max(0, ledger.max_loras - shared.foreign_adapters) if shared
        else ledger.max_loras,
        adapters=frozenset(hb.adapters) if hb is not None else frozenset(),
        shared=shared is not None,
    )
    if cache is not None:
        cache._views[ledger.backend_id] = _ViewMemo(key, view, complete, sessions)
    return view


def build_snapshot(now: float, pending: Mapping[str, Sequence[PendingItem]], fleet: FleetRead,
                   meta: Mapping[str, ResidentMeta],
                   completions: Sequence[Completion] = (),
                   cache: ViewCache | None = None) -> Snapshot:
    """The policy's snapshot. The same with or without `cache` (which only saves rebuilding
    what did not change since the snapshot it last built)."""
    return Snapshot(
        now=now,
        pending={w: tuple(items) for w, items in pending.items() if items},
        backends=tuple(backend_view(fleet.ledgers[b], fleet.heartbeats.get(b), meta, cache)
                       for b in sorted(fleet.ledgers)),
        mixture_target=dict(fleet.mixture),
        consumed=dict(fleet.consumed),
        new_completions=tuple(completions),
    )

