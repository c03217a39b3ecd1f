"""Session queues: enqueue into `pending:<w>`, decode entries, dead-letter what cannot be read.

A session's body is stored once, in `rb:{ns}:body:<sid>` (compact JSON, broker/body.py). Queue
entries carry only what finds it: `sid` (pending), `sid` and `enqueued_at` (requeue), `sid` and
`reserved` (admitted); readers fetch the bodies of a batch of entries in one pipelined round trip
(`read_bodies`). The per-session hash `rb:{ns}:session:<sid>` is the source of truth for where
a session is: `state` (pending → admitted → running → done | failed | cancelled), `workload`,
`enqueued_at`, `pending_entry`; after admission `backend`, `reserved`, `admitted_at`,
`admitted_entry`; `running_at`, `finished_at`, `requeued_at` as they happen.

Earlier versions kept the body twice: as a `session` field of every queue entry and of the hash.
Such entries are still read (their body is in the entry), and such a hash's `session` field is
read where the body key is missing; a requeue moves it to the body key.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from pydantic import ValidationError

from broker.keys import BROKER_GROUP, Keys
from broker.body import dump_body, load_body
from broker.ledger import EnqueueLimits
from broker.plans import Plan, Runner, ScriptCall, durable, script
from broker.redis_conn import NO_WAIT, Durability
from broker.scripts import Scripts
from broker.session import ID_RE as SESSION_ID_RE
from broker.session import Session
from broker.streams import as_text, ensure_group

ENQUEUE_CHUNK = 500  # sessions per enqueue script call: bounds one script's run time


def _first_error(exc: ValidationError, item: str) -> str:
    """The first error, named from `item`: `item.field: reason`, or `item: reason` when it is
    about the item as a whole. A validator's reason that names a key inside its field first
    ("x: ...", e.g. a metadata key) extends the field: `item.metadata.x: ...`."""
    err = exc.errors()[0]
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    field = ".".join(str(p) for p in err.get("loc", ()))
    if field:
        inner, sep, rest = msg.partition(": ")
        if sep and inner and not any(c in inner for c in " .[]'\""):
            return f"{item}.{field}.{inner}: {rest}"
        return f"{item}.{field}: {msg}"
    # A whole-model check has no location; its message starts with the field it is about.
    # Anything else without one is about the item itself (e.g. not an object at all).
    return f"{item}.{msg}" if err.get("type") == "value_error" else f"{item}: {msg}"


def validate_batch(
    sessions: Iterable[Session | Mapping[str, Any]],
    known_workloads: set[str],
    limits: EnqueueLimits | None = None,
) -> list[Session]:
    """Check a whole batch before anything is written; the first bad item rejects all of it.

    Raises ValueError naming the item and field: `sessions[3].max_tokens: ...`. `limits` are
    the registered backends' (a limit no backend has reported is not judged). An id given twice
    with different bodies rejects the batch; the same session given twice is kept once.
    """
    limits = limits or EnqueueLimits()
    out: list[Session] = []
    seen: dict[str, tuple[int, Session]] = {}
    for i, raw in enumerate(sessions):
        if isinstance(raw, Session):
            s = raw
        else:
            try:
                s = Session.model_validate(raw)
            except ValidationError as exc:
                raise ValueError(_first_error(exc, f"sessions[{i}]")) from None
        first = seen.get(s.session_id)
        if first is not None:
            if first[1] != s:
                raise ValueError(f"sessions[{i}].session_id: {s.session_id!r} is also "
                                 f"sessions[{first[0]}], with a different body")
            continue
        seen[s.session_id] = (i, s)
        if s.workload not in known_workloads:
            raise ValueError(
                f"sessions[{i}].workload: unknown workload {s.workload!r}; "
                f"known: {', '.join(sorted(known_workloads))}"
            )
        if limits.max_model_len is not None and s.prompt_len_hint > limits.max_model_len:
            field = "prompt_token_ids" if s.prompt_token_ids is not None else "prompt_text"
            raise ValueError(
                f"sessions[{i}].{field}: prompt of {s.prompt_len_hint} tokens does not fit any "
                f"backend (largest max_model_len is {limits.max_model_len})"
            )
        unfit = session_fit_error(s, limits)
        if unfit is not None:
            raise ValueError(f"sessions[{i}].{unfit}")
        unserved = serving_error(s, limits)
        if unserved is not None:
            raise ValueError(f"sessions[{i}].{unserved}")
        if limits.vocab_size is not None and s.prompt_token_ids:
            top = max(s.prompt_token_ids)
            if top >= limits.vocab_size:
                raise ValueError(
                    f"sessions[{i}].prompt_token_ids: token id {top} is not below the served "
                    f"vocabulary size {limits.vocab_size}"
                )
        out.append(s)
    return out


def session_fit_error(s: Session, limits: EnqueueLimits) -> str | None:
    """Why a new session's first request fits no backend with these limits (the largest
    context and KV cache among them), starting with the field to blame; None when it fits or a
    limit is unknown. A resumed session is not judged (it ran, and its runner caps each turn at
    the context left), nor a text prompt's length (the engine tokenizes it)."""
    if s.resume_from is not None:
        return None
    prompt = len(s.prompt_token_ids) if s.prompt_token_ids is not None else 1
    need = prompt + s.max_tokens
    if limits.max_model_len is not None and need > limits.max_model_len:
        return (f"max_tokens: a prompt of {prompt} tokens and max_tokens {s.max_tokens} need "
                f"{need} tokens of context; no backend has that (largest max_model_len is "
                f"{limits.max_model_len})")
    if limits.capacity_tokens is not None and need > limits.capacity_tokens:
        return (f"max_tokens: a prompt of {prompt} tokens and max_tokens {s.max_tokens} need "
                f"{need} tokens of KV cache; no backend has that (largest holds "
                f"{limits.capacity_tokens})")
    return None


def serving_error(s: Session, limits: EnqueueLimits) -> str | None:
    """Why `s` could never run (an adapter the namespace has not registered; a model or LoRA
    that no registered backend serves), starting with the field to blame; None when it could.
    Backends are judged once one has registered, and one that is down still counts: its worker
    may come back, and the session waits for it."""
    if (s.adapter is not None and limits.adapters is not None
            and s.adapter not in limits.adapters):
        known = ", ".join(sorted(limits.adapters)) or "none"
        return (f"adapter: {s.adapter!r} is not registered in this namespace (registered: "
                f"{known}); register it with RolloutClient.register_adapter(name, path)")
    if limits.max_model_len is None:
        return None  # no backend has registered yet
    if s.model is not None and limits.models and s.model not in limits.models:
        return (f"model: {s.model!r} is served by no registered backend; served: "
                f"{', '.join(sorted(limits.models))}")
    if s.adapter is not None and not limits.lora:
        return (f"adapter: {s.adapter!r} needs an engine with LoRA on, and no registered "
                "backend has one (start vLLM with --enable-lora)")
    return None


def enqueue(keys: Keys, sessions: Sequence[Session], now: float | None = None,
            durability: Durability = NO_WAIT) -> Plan[list[str]]:
    """Add validated sessions; returns the ids that were new (repeats are no-ops). Each chunk
    counts as added once `durability`'s replicas hold it (NotReplicatedError otherwise)."""
    now = time.time() if now is None else now
    new: list[str] = []
    for start in range(0, len(sessions), ENQUEUE_CHUNK):
        chunk = sessions[start:start + ENQUEUE_CHUNK]
        skeys: list[str] = []
        args: list[Any] = [repr(now)]
        for s in chunk:
            skeys += [keys.session(s.session_id), keys.pending(s.workload), keys.body(s.session_id)]
            args += [s.session_id, s.workload, dump_body(s)]
        (flags,) = yield from durable([ScriptCall("enqueue", skeys, args)], durability)
        new += [s.session_id for s, f in zip(chunk, flags) if int(f) == 1]
    return new


def dead_letter(keys: Keys, stream: str, entry_id: str, fields: Mapping, reason: str,
                group: str = BROKER_GROUP) -> Plan[None]:
    """Move an unreadable entry of `stream` (read by consumer group `group`) to the dead-letter
    stream with its reason, and mark its session `dead_lettered` if this was its queue entry
    (lua/dead_letter.lua)."""
    sid = entry_sid(fields)
    session_key = keys.session(sid) if sid is not None else keys.dead_letter
    body_key = keys.body(sid) if sid is not None else keys.dead_letter
    args: list = [entry_id, group, reason, repr(time.time())]
    for k, v in fields.items():
        args += [as_text(k), v]
    yield script("dead_letter", [stream, keys.dead_letter, session_key, keys.settings, body_key],
                 args)


class SessionQueue:
    """Writes and reads the session streams. Holds a client, never subclasses it."""

    def __init__(self, client: redis.Redis, keys: Keys, scripts: Scripts) -> None:
        self._client = client
        self._keys = keys
        self._scripts = scripts
        self._runner = Runner(client, scripts=scripts)

    def enqueue(self, sessions: Sequence[Session], now: float | None = None) -> list[str]:
        """Add validated sessions; returns the ids that were new (repeats are no-ops)."""
        return self._runner.run(enqueue(self._keys, sessions, now))

    def ensure_broker_groups(self, workloads: Iterable[str]) -> None:
        """Create group "broker" on each pending/requeue stream (id 0: sees earlier entries)."""
        for w in workloads:
            for stream in (self._keys.pending(w), self._keys.requeue(w)):
                ensure_group(self._client, stream, BROKER_GROUP)

    def dead_letter(self, stream: str, entry_id: str, fields: Mapping, reason: str,
                    group: str = BROKER_GROUP) -> None:
        self._runner.run(dead_letter(self._keys, stream, entry_id, fields, reason, group))

    def state(self, session_id: str) -> str | None:
        v = self._client.hget(self._keys.session(session_id), "state")
        return None if v is None else as_text(v)


@dataclass(frozen=True, slots=True)
class PendingEntry:
    """A readable entry of a pending/requeue stream."""

    stream: str
    entry_id: str
    session: Session
    enqueued_at: float  # unix seconds when the trainer enqueued it


def entry_body(fields: Mapping) -> bytes | str | None:
    """The body an entry carries itself: only an entry written by an earlier version has one."""
    return fields.get(b"session", fields.get("session"))


def entry_sid(fields: Mapping) -> str | None:
    """The entry's session id when it is one a key can be built from, else None."""
    sid = fields.get(b"sid", fields.get("sid"))
    if sid is None:
        return None
    sid = as_text(sid)
    return sid if SESSION_ID_RE.match(sid) else None


def read_bodies(client: redis.Redis, keys: Keys, sids: Sequence[str]) -> list[bytes | None]:
    """The stored bodies of `sids` (None where there is none), in one pipelined round trip; a
    second one only for sessions enqueued by an earlier version, whose body is in their hash."""
    if not sids:
        return []
    pipe = client.pipeline(transaction=False)
    for sid in sids:
        pipe.get(keys.body(sid))
    bodies: list[bytes | None] = list(pipe.execute())
    missing = [i for i, b in enumerate(bodies) if b is None]
    if missing:
        pipe = client.pipeline(transaction=False)
        for i in missing:
            pipe.hget(keys.session(sids[i]), "session")
        for i, b in zip(missing, pipe.execute()):
            bodies[i] = b
    return bodies


def with_bodies(client: redis.Redis, keys: Keys, entries: Sequence[Mapping]) -> list[Mapping]:
    """The fields of queue entries, each entry that carries no body given its stored one as a
    `session` field (fetched in one round trip for all of them), so that `decode_entry` and
    `dead_letter` see it whichever version wrote the entry."""
    need = [i for i, f in enumerate(entries) if f and entry_body(f) is None
            and entry_sid(f) is not None]
    out = list(entries)
    if need:
        bodies = read_bodies(client, keys, [entry_sid(entries[i]) or "" for i in need])
        for i, body in zip(need, bodies):
            if body is not None:
                out[i] = {**entries[i], b"session": body}
    return out


def decode_entry(stream: str, entry_id: str, fields: Mapping) -> PendingEntry | str:
    """The entry, or the reason it cannot be read (the caller dead-letters it). `fields` hold
    its body as `session` (`with_bodies` adds the stored one to an entry that has none).

    Fields arrive with bytes keys from a client that does not decode responses."""
    sid = fields.get(b"sid", fields.get("sid"))
    body = entry_body(fields)
    if sid is None:
        return "entry has no 'sid' field"
    if body is None:
        return f"session {as_text(sid)!r} has no stored body"
    try:
        session = load_body(body)
    except ValidationError as exc:
        return f"session JSON does not validate: {_first_error(exc, 'session')}"
    except ValueError as exc:
        return f"session JSON does not parse: {exc}"
    if session.session_id != as_text(sid):
        return f"sid {as_text(sid)!r} does not match session_id {session.session_id!r}"
    # A pending entry's id is its enqueue time (ms); a requeued one carries the original time.
    stamp = fields.get(b"enqueued_at", fields.get("enqueued_at"))
    try:
        enqueued_at = float(stamp) if stamp is not None else int(entry_id.split("-")[0]) / 1000.0
    except ValueError:
        return f"enqueued_at {stamp!r} is not a number"
    return PendingEntry(stream=stream, entry_id=entry_id, session=session,
                        enqueued_at=enqueued_at)
