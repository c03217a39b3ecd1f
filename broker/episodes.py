"""Episodes the agent drives: the Redis side of the session gateway (gateway/).

An *episode* is a session whose turns are not run by a worker but by the agent's own code,
which calls the gateway's OpenAI-compatible endpoint once per turn and runs its tools between
calls for as long as it likes. Its life, in Redis (every step one Lua script, lua/episode_*.lua):

    open     the trainer opens it (`open_episode`): state 'parked', holding no KV, in no queue;
             its spec (workload, group, sampling, limits, metadata) at `episode:<id>`.
    request  a call finds it parked and asks for admission (`request_admission`): its body is
             the session as it goes on (the whole context so far as its prompt), queued as
             any session ('pending'); the broker's policy admits it and, seeing `driver` =
             'agent', announces it on `episodes:admitted` instead of a worker's stream.
    begin    the call starts on the backend it was admitted to (`begin_call`): 'running'.
    commit   the call's turn records and reply are recorded (`commit_call`), once: a retried
             call that two gateways both ran is recorded by the first only.
    release  no call for the idle timeout: the broker releases its charge (lua/episode_release)
             and it is 'parked' again; its next call asks for admission again.
    close    the trainer closes it with a reward (`close_episode`): one ordinary
             `SessionResult` on the results stream (lua/finish.lua), as a worker publishes.

A backend that dies takes its episodes with it as it takes any session (lua/requeue.lua):
they go back to the front of their queue and the next call (or the call in flight, which the
gateway runs again) waits for their admission elsewhere.

Everything here is a plan (broker/plans.py): the gateway runs it on an asyncio connection,
the trainer's client on a blocking one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from broker.body import dump_body
from broker.completions import CompletionStats, completion_json, completion_of
from broker.keys import Keys
from broker.plans import Cmd, Plan, batch, cmd, script
from broker.session import Session, SessionResult, SessionState, TurnRecord
from broker.streams import as_text

DEFAULT_EPISODE_MAX_TOKENS = 4096  # per call, unless the spec says
DEFAULT_EPISODE_MAX_TURNS = 64  # calls
# Fields of the session a spec may not carry: the prompt is the first call's messages.
_NOT_IN_SPEC = ("prompt_token_ids", "prompt_text", "resume_from", "driver")


def episode_spec(fields: Mapping[str, Any]) -> Session:
    """The validated spec of an episode: a session's fields without a prompt (its first call
    brings it), e.g. `{"session_id": "ep-1", "workload": "agentic", "max_turns": 20}`.
    Returned as a template `Session` whose prompt is a placeholder: `session_for` makes the
    real one. Errors name the field, as enqueue's do."""
    if not isinstance(fields, Mapping):
        raise ValueError(f"episode: must be a mapping of session fields, not "
                         f"{type(fields).__name__}")
    raw = dict(fields)
    given = [f for f in _NOT_IN_SPEC if raw.get(f) not in (None, "agent")]
    if given:
        raise ValueError(f"{given[0]}: an episode gets its prompt from its first call's "
                         "messages; leave it out")
    raw.setdefault("max_tokens", DEFAULT_EPISODE_MAX_TOKENS)
    raw.setdefault("max_turns", DEFAULT_EPISODE_MAX_TURNS)
    raw["driver"] = "agent"
    try:
        # One placeholder token makes a valid session of it: the spec's own fields are
        # checked by the one session model, and the placeholder never leaves this function.
        return Session.model_validate({**raw, "prompt_token_ids": [0]})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "episode"
        raise ValueError(f"{where}: {err['msg']}") from None


def episode_base_url(gateway_url: str, episode_id: str) -> str:
    """Where the agent's OpenAI client points (`base_url`): the episode's own API root."""
    return f"{gateway_url.rstrip('/')}/sessions/{episode_id}/v1"


def spec_json(spec: Session) -> str:
    return spec.model_dump_json(exclude={"prompt_token_ids", "prompt_text", "resume_from"},
                                exclude_defaults=True)


def load_spec(raw: bytes | str) -> Session:
    return episode_spec(json.loads(raw))


def session_for(spec: Session, context_ids: list[int], calls_done: int) -> Session:
    """The session as the broker admits it now: the whole context so far as its prompt, the
    calls it may still make as its turns."""
    return Session.model_validate({
        **spec.model_dump(exclude={"prompt_token_ids", "prompt_text", "resume_from"}),
        "prompt_token_ids": context_ids,
        "max_turns": max(1, spec.max_turns - calls_done)})


@dataclass(frozen=True, slots=True)
class EpisodeView:
    """An episode's state hash, as one read found it."""

    state: str | None  # a SessionState value; None: no such episode (or its hash expired)
    workload: str = ""
    backend: str | None = None  # while admitted/running
    turns: int = 0  # calls recorded
    mark: int = 0  # the last call's mark: its message count (chat) or prompt length (text)
    context_tokens: int = 0
    enqueued_at: float | None = None
    admitted_at: float | None = None
    last_call_at: float | None = None
    agent_wait_s: float = 0.0
    kv_token_s: float = 0.0
    releases: int = 0  # times its charge was released while the agent idled
    requeued_from: str | None = None  # a dead backend it was taken back from

    @property
    def ended(self) -> bool:
        return self.state in (SessionState.done, SessionState.failed, SessionState.cancelled,
                              SessionState.dead_lettered)


_VIEW_FIELDS = ("state", "workload", "backend", "turns", "mark", "context_tokens",
                "enqueued_at", "admitted_at", "last_call_at", "agent_wait_s", "kv_token_s",
                "releases", "requeued_from", "driver")


def _float(v: Any) -> float | None:
    return None if v is None else float(v)


def read_view(keys: Keys, sid: str) -> Plan[EpisodeView]:
    raw = yield cmd("hmget", keys.session(sid), *_VIEW_FIELDS)
    f = dict(zip(_VIEW_FIELDS, (as_text(v) if v is not None else None for v in raw)))
    if f["state"] is None or f["driver"] != "agent":
        return EpisodeView(state=None)
    return EpisodeView(
        state=f["state"], workload=f["workload"] or "", backend=f["backend"],
        turns=int(f["turns"] or 0), mark=int(f["mark"] or 0),
        context_tokens=int(f["context_tokens"] or 0), enqueued_at=_float(f["enqueued_at"]),
        admitted_at=_float(f["admitted_at"]), last_call_at=_float(f["last_call_at"]),
        agent_wait_s=float(f["agent_wait_s"] or 0.0), kv_token_s=float(f["kv_token_s"] or 0.0),
        releases=int(f["releases"] or 0),
        requeued_from=f["requeued_from"])


def read_spec(keys: Keys, sid: str) -> Plan[Session | None]:
    raw = yield cmd("get", keys.episode(sid))
    return None if raw is None else load_spec(raw)


def read_turns(keys: Keys, sid: str) -> Plan[list[TurnRecord]]:
    raw = yield cmd("lrange", keys.episode_turns(sid), 0, -1)
    return [TurnRecord.model_validate_json(r) for r in raw]


def read_text(keys: Keys, sid: str) -> Plan[str]:
    raw = yield cmd("get", keys.episode_text(sid))
    return "" if raw is None else as_text(raw)


def read_reply(keys: Keys, sid: str) -> Plan[str | None]:
    raw = yield cmd("get", keys.episode_reply(sid))
    return None if raw is None else as_text(raw)


def open_episode(keys: Keys, spec: Session, now: float | None = None) -> Plan[bool]:
    """Open it (state 'parked'); False when the namespace has seen the id."""
    reply = yield script("episode_open", [keys.session(spec.session_id),
                                          keys.episode(spec.session_id)],
                         [spec.session_id, spec.workload, spec_json(spec),
                          repr(time.time() if now is None else now)])
    return as_text(reply) == "ok"


def request_admission(keys: Keys, session: Session, front: bool) -> Plan[str]:
    """Queue a parked episode for admission, as `session` (`session_for`): 'queued', or the
    state it is in instead."""
    sid, w = session.session_id, session.workload
    queue = keys.requeue(w) if front else keys.pending(w)
    reply = yield script("episode_request", [keys.session(sid), keys.body(sid), queue, keys.events],
                         [sid, dump_body(session), repr(time.time())])
    return as_text(reply)


def begin_call(keys: Keys, sid: str, backend: str, deadline: float) -> Plan[str]:
    """Start a call on `backend` (the one it is admitted to): 'ok', or why not (its state, or
    'moved')."""
    reply = yield script("episode_begin", [keys.session(sid), keys.idle],
                         [sid, backend, repr(time.time()), repr(deadline)])
    return as_text(reply)


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One finished call, as `commit_call` records it."""

    backend: str
    calls_before: int
    mark: int  # what identifies the call (`EpisodeView.mark`)
    reply_json: str
    context_tokens: int
    agent_wait_s: float
    kv_token_s: float
    records: tuple[TurnRecord, ...]
    text: str = ""  # a text completions episode's prompt and completions so far


def commit_call(keys: Keys, sid: str, call: CallRecord) -> Plan[str]:
    """'ok', 'conflict' (another run of the same call was recorded first), or the state that
    ended it."""
    reply = yield script(
        "episode_commit",
        [keys.session(sid), keys.episode_turns(sid), keys.episode_reply(sid), keys.idle,
         keys.settings, keys.episode_text(sid)],
        [sid, call.backend, call.calls_before, call.mark, call.reply_json,
         repr(time.time()), call.context_tokens, repr(call.agent_wait_s), repr(call.kv_token_s),
         call.text, *(r.model_dump_json() for r in call.records)])
    return as_text(reply)


def episode_result(spec: Session, view: EpisodeView, records: list[TurnRecord],
                   reward: float | None, now: float) -> tuple[SessionResult, CompletionStats]:
    """The episode as a worker-run session's result: its calls as turns, in order."""
    per_turn: dict[int, int] = {}
    for r in records:
        per_turn[r.turn] = per_turn.get(r.turn, 0) + len(r.output_token_ids)
    result = SessionResult(
        session_id=spec.session_id, workload=spec.workload, group_id=spec.group_id,
        group_size=spec.group_size, status=SessionState.done,
        backend_id=view.backend or view.requeued_from, turns=len(per_turn),
        prompt_tokens=len(records[0].input_token_ids) if records else 0,
        output_tokens=sum(per_turn.values()), turn_records=records, reward=reward,
        enqueued_at=view.enqueued_at, admitted_at=view.admitted_at, finished_at=now,
        policy_version=spec.policy_version)
    stats = CompletionStats(turn_output_tokens=[per_turn[t] for t in sorted(per_turn)],
                            tool_wait_s=view.agent_wait_s, kv_token_seconds=view.kv_token_s)
    return result, stats


def close_episode(keys: Keys, sid: str, reward: float | None) -> Plan[str]:
    """Publish the episode's one result with `reward` (lua/finish.lua), releasing what it holds:
    'ok', the state that ended it before ('done', 'failed', 'cancelled'), or 'unknown'."""
    for _ in range(5):
        view = yield from read_view(keys, sid)
        if view.state is None:
            return "unknown"
        if view.ended:
            return view.state
        spec = yield from read_spec(keys, sid)
        records = yield from read_turns(keys, sid)
        if spec is None:
            return "unknown"
        now = time.time()
        result, stats = episode_result(spec, view, records, reward, now)
        # The backend the script checks: where it holds KV, or the dead one it was taken back
        # from (finish.lua lets that one finish it), or none (parked, or waiting for a call's
        # admission); then the ledger keys are never touched.
        b = view.backend if view.state in ("admitted", "running") else view.requeued_from
        ledger = [keys.ledger(b), keys.ledger_sessions(b), keys.admitted(b)] if b else \
            [keys.mixture] * 3
        reply = as_text((yield script("finish", [
            keys.session(sid), *ledger, keys.results, keys.events, keys.kv_seconds,
            keys.requeue(view.workload), keys.stats, keys.settings, keys.body(sid),
            keys.completions],
            [sid, b or "", "done", result.model_dump_json(), stats.model_dump_json(),
             repr(now), repr(stats.kv_token_seconds), result.output_tokens,
             completion_json(completion_of(result, stats))])))
        if reply == "ok":
            yield from forget(keys, sid)
            return "ok"
        if reply == "duplicate":
            return (yield from read_view(keys, sid)).state or "unknown"
        # 'stale': it moved between our read and the script (admitted, requeued): read again.
    raise RuntimeError(f"episode_id: {sid!r} kept moving between backends; retry")


def forget(keys: Keys, sid: str) -> Plan[None]:
    """Drop an ended episode's spec, records and reply (its state hash expires by retention)."""
    yield batch([Cmd("delete", (keys.episode(sid), keys.episode_turns(sid),
                                keys.episode_reply(sid), keys.episode_text(sid))),
                 Cmd("zrem", (keys.idle, sid))])


def due_releases(keys: Keys, now: float, limit: int = 64) -> Plan[list[tuple[str, str | None]]]:
    """Episodes whose idle time has passed, with the backend each is on: (sid, backend)."""
    due = yield cmd("zrangebyscore", keys.idle, "-inf", repr(now), start=0, num=limit)
    sids = [as_text(s) for s in due]
    if not sids:
        return []
    backends = yield batch([Cmd("hget", (keys.session(s), "backend")) for s in sids])
    return [(s, as_text(b) if b else None) for s, b in zip(sids, backends)]
