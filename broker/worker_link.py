"""The worker-side API: how a GPU worker (or a simulated backend) talks to the broker.

One `WorkerLink` per backend (one engine). The worker's loop, in order:

    link = WorkerLink(redis_url, namespace, backend_id)
    link.register(capacity_tokens=C, max_model_len=L)      # once at start (idempotent)
    while running:
        link.heartbeat(metrics, progress)                  # every ~1 s, TTL ≈ 3 beats
        for a in link.read_admitted(count=64, block_ms=1000):
            if link.mark_running(a.session.session_id):    # False: cancelled/moved: drop it
                ... run a.session on the engine ...
                link.finish(result, stats)                 # exactly one result, idempotent
                # or, when the engine could not serve it:
                link.hand_back([a.session], "engine: ...")  # run again (an attempt counted)

A worker that restarts with the same backend id first gets back the admitted entries it had read
but not finished (its consumer-group backlog), so nothing admitted to it is lost. If its
heartbeat lapsed meanwhile, the broker has requeued those sessions: a finish is still taken
while nobody else has been given the session (first finish wins), and refused ('stale') once
another backend has it, so no result is published twice.

Every call may raise one of `broker.redis_conn.OUTAGE_ERRORS` while Redis is down; each is
idempotent, so the caller retries it as it is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis
from pydantic import BaseModel, ConfigDict, Field

from broker.adapters import AdapterRecord
from broker.adapters import read as read_adapter
from broker.body import dump_body, load_body
from broker.completions import CompletionStats, completion_json, completion_of
from broker.heartbeat import (DEFAULT_HEARTBEAT_TTL_S, EngineMetrics, HeartbeatRecord,
                              SessionProgress, SharedPart)
from broker.keys import WORKERS_GROUP, Keys, check_backend_id
from broker.ledger import Ledger
from broker.plans import Runner, ScriptCall, durable
from broker.policies.base import Completion
from broker.queue import with_bodies
from broker.redis_conn import connect, durability, is_outage
from broker.scripts import Scripts
from broker.session import Session, SessionResult, SessionState
from broker.streams import BacklogCursor, as_text, read_group
from broker.weights import PAUSED_EVENTS_MAXLEN, WeightsState, read_state


log = logging.getLogger("rollout_broker.worker")


@dataclass(frozen=True, slots=True)
class AdmittedSession:
    entry_id: str
    session: Session
    reserved_tokens: int

    @property
    def admitted_ms(self) -> int:
        """When the broker admitted it, in Unix milliseconds: its stream entry's id."""
        return int(self.entry_id.split("-", 1)[0])


class WorkerLink:
    def __init__(self, redis_url: str, namespace: str, backend_id: str,
                 heartbeat_ttl_s: float = DEFAULT_HEARTBEAT_TTL_S) -> None:
        self.backend_id = check_backend_id(backend_id)
        self.keys = Keys(namespace)
        self._client = connect(redis_url)
        self.durability = durability(redis_url)  # finish and hand_back wait for replicas
        self._scripts = Scripts(self._client)
        self._runner = Runner(self._client, scripts=self._scripts)
        self._ledger = Ledger(self._client, self.keys)
        self.heartbeat_ttl_ms = int(heartbeat_ttl_s * 1000)
        self._cursor = BacklogCursor()  # entries delivered before a restart come first

    def close(self) -> None:
        self._client.close()

    def register(self, capacity_tokens: int, max_model_len: int,
                 vocab_size: int | None = None, engine_url: str | None = None,
                 model: str | None = None, max_loras: int = 0) -> None:
        """`engine_url` and `model`: where the session gateway reaches this backend's engine
        (vLLM's HTTP API) and the model it serves; `max_loras`: the LoRA adapters its engine
        mixes in a step (0: LoRA off)."""
        self._ledger.register_backend(self.backend_id, capacity_tokens, max_model_len, vocab_size,
                                      engine_url, model, max_loras)
        self._cursor.reset()

    def heartbeat(self, metrics: EngineMetrics, progress: Sequence[SessionProgress] = (),
                  at: float | None = None, adapters: Sequence[str] = (),
                  draining: bool = False, shared: SharedPart | None = None) -> None:
        """Refresh this backend's liveness (the key's TTL) and carry `metrics` as taken at unix
        time `at` (default now): an engine whose /metrics answers slowly sends older numbers,
        with their age, but the beat itself is on time. `draining`: the worker is stopping;
        the broker admits nothing more here. `shared`: on an engine several namespaces share,
        this namespace's part of it (broker/shares.py)."""
        now = time.time()
        record = HeartbeatRecord(backend_id=self.backend_id, at=now if at is None else at,
                                 metrics=metrics, sessions=list(progress), sent_at=now,
                                 adapters=sorted(adapters), draining=draining, shared=shared)
        k = self.keys
        reply = as_text(self._scripts.heartbeat(
            keys=[k.heartbeat(self.backend_id), k.ledger(self.backend_id), k.events],
            args=[self.backend_id, record.model_dump_json(), self.heartbeat_ttl_ms]))
        if reply != "ok":
            raise NotRegistered(f"heartbeat: backend {self.backend_id!r} is not registered "
                                f"({reply})")

    def withdraw(self) -> None:
        """Hand everything admitted here back now: drop our heartbeat (the broker's health
        signal) and wake the broker, which reclaims this backend's sessions to the front of
        their queues at once instead of after the TTL. A draining worker calls this after its
        last finish; a later `finish` of a handed-back session returns 'stale'."""
        k = self.keys
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(k.heartbeat(self.backend_id))
        pipe.xadd(k.events, {"kind": "withdraw", "backend": self.backend_id},
                  maxlen=10000, approximate=True)
        pipe.execute()

    def stake(self) -> tuple[int, float, float | None]:
        """This backend's ledger as an engine several namespaces share needs it: the
        reservations, α, and when the namespace's broker last said it has sessions pending
        that this backend could run (`waiting_at`, None if never)."""
        reserved, alpha, waiting_at = self._client.hmget(self.keys.ledger(self.backend_id),
                                                         "reserved", "alpha", "waiting_at")
        return (int(reserved or 0), float(alpha or 1.0),
                float(waiting_at) if waiting_at is not None else None)

    def adapter(self, name: str) -> AdapterRecord | None:
        """LoRA adapter `name` as the namespace registered it (broker/adapters.py), or None."""
        return self._runner.run(read_adapter(self.keys, name))

    # -- weight updates (broker/weights.py) ------------------------------------------------------
    def weights_state(self) -> WeightsState:
        return self._runner.run(read_state(self.keys))

    def read_control(self, after: str, block_ms: int) -> list[tuple[str, dict[str, str]]]:
        """Pause and resume orders after entry `after`, waiting up to `block_ms` for one."""
        reply = self._client.xread({self.keys.control: after}, count=100, block=block_ms)
        return [(as_text(eid), {as_text(k): as_text(v) for k, v in fields.items()})
                for _, entries in reply or [] for eid, fields in entries]

    def ack_paused(self, epoch: int) -> None:
        """This backend's engine is paused for pause `epoch` (the hash, then the event a
        pausing trainer waits on, in one round trip)."""
        pipe = self._client.pipeline(transaction=False)
        pipe.hset(self.keys.paused_acks, self.backend_id, epoch)
        pipe.xadd(self.keys.paused_events, {"backend": self.backend_id, "epoch": epoch},
                  maxlen=PAUSED_EVENTS_MAXLEN, approximate=True)
        pipe.execute()

    def read_admitted(self, count: int = 64, block_ms: int | None = 1000) -> list[AdmittedSession]:
        """Sessions admitted here: first our unfinished backlog, then new ones (blocking)."""
        try:
            return self._read_admitted(count, block_ms)
        except Exception as exc:
            if is_outage(exc):
                # Entries this read delivered may never have reached us (a reply lost to a
                # reset, or their bodies not read): read our backlog again first, so that none
                # stays admitted for good.
                self._cursor.reset()
            raise

    def _read_admitted(self, count: int, block_ms: int | None) -> list[AdmittedSession]:
        stream = self.keys.admitted(self.backend_id)
        backlog = not self._cursor.done
        start, block = self._cursor.read_args(block_ms)
        try:
            reply = read_group(self._client, WORKERS_GROUP, self.backend_id, {stream: start},
                               count, block)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # The broker reclaimed this backend (heartbeat lapsed) and dropped its stream.
            raise BackendReclaimed(self.backend_id) from None
        entries = reply[0][1] if reply else []
        self._cursor.advance(entries, count)
        if backlog and not entries:  # the backlog is empty: wait for new ones
            return self._read_admitted(count, block_ms)
        live = []
        for entry_id, fields in entries:
            if not fields:  # finished or cancelled meanwhile: the scripts deleted the entry
                self._client.xack(stream, WORKERS_GROUP, entry_id)
                continue
            live.append((entry_id, fields))
        # An entry carries the id; the bodies come in one round trip for the batch (an entry an
        # earlier version wrote still carries its own).
        out = []
        for (entry_id, _), f in zip(live, with_bodies(
                self._client, self.keys, [{_as_bytes(k): v for k, v in fields.items()}
                                          for _, fields in live])):
            if b"session" not in f:  # its body is gone (the session ended meanwhile): drop it
                log.warning("backend %s: admitted entry %s (session %s) has no stored body; "
                            "dropped", self.backend_id, as_text(entry_id),
                            as_text(f.get(b"sid", b"?")))
                self._client.xack(stream, WORKERS_GROUP, entry_id)
                continue
            out.append(AdmittedSession(entry_id=as_text(entry_id),
                                       session=load_body(f[b"session"]),
                                       reserved_tokens=int(f[b"reserved"])))
        return out

    def mark_running(self, session_id: str, now: float | None = None) -> bool:
        """True: run it. False: it was cancelled, finished or moved away; drop it."""
        return self.mark_running_many([session_id], now)[0]

    def mark_running_many(self, session_ids: Sequence[str], now: float | None = None) -> list[bool]:
        """`mark_running` for several sessions in one round trip."""
        at = repr(time.time() if now is None else now)
        pipe = self._client.pipeline(transaction=False)
        for sid in session_ids:
            self._scripts.mark_running(keys=[self.keys.session(sid)], args=[self.backend_id, at],
                                       client=pipe)
        return [as_text(r) == "ok" for r in pipe.execute()] if session_ids else []

    def checkpoint(self, session: Session) -> bool:
        """Store `session` (with `resume_from`: the turns it has finished) as the body a requeue
        uses if this worker or its engine dies mid-session (lua/checkpoint.lua). False: the
        session no longer runs here."""
        return int(self._scripts.checkpoint(
            keys=[self.keys.session(session.session_id)],
            args=[self.backend_id, dump_body(session)])) == 1

    def finish(self, result: SessionResult, stats: CompletionStats | None = None,
               now: float | None = None) -> str:
        """Publish the session's result. Returns 'ok', 'duplicate' or 'stale' (not published)."""
        return self.finish_many([(result, stats)], now)[0]

    def finish_many(self, finished: Sequence[tuple[SessionResult, CompletionStats | None]],
                    now: float | None = None) -> list[str]:
        """`finish` for several sessions in one round trip; one reply per session, in order.
        Done only once the connection's replicas hold them (else NotReplicatedError: retry)."""
        now = time.time() if now is None else now
        calls = [self._finish(result, stats, now) for result, stats in finished]
        return [as_text(r) for r in self._runner.run(durable(calls, self.durability))]

    def _finish(self, result: SessionResult, stats: CompletionStats | None,
                now: float) -> ScriptCall:
        if result.status not in (SessionState.done, SessionState.failed):
            raise ValueError(f"status: a worker finishes with done or failed, not {result.status!r}")
        if result.backend_id not in (None, self.backend_id):
            raise ValueError(f"backend_id: result names {result.backend_id!r}, not this backend")
        stats = stats or CompletionStats()
        result = result.model_copy(update={"backend_id": self.backend_id,
                                           "finished_at": result.finished_at or now})
        k, b = self.keys, self.backend_id
        return ScriptCall(
            "finish",
            keys=[k.session(result.session_id), k.ledger(b), k.ledger_sessions(b), k.admitted(b),
                  k.results, k.events, k.kv_seconds, k.requeue(result.workload), k.stats,
                  k.settings, k.body(result.session_id), k.completions],
            args=[result.session_id, b, result.status.value, result.model_dump_json(),
                  stats.model_dump_json(), repr(now), repr(stats.kv_token_seconds),
                  str(result.output_tokens), completion_json(completion_of(result, stats))])


    def hand_back(self, sessions: Sequence[Session], why: str, now: float | None = None,
                  replace_body: bool = False) -> tuple[int, int]:
        """Give sessions admitted here back to the front of their queues, because the engine
        could not serve them (`why` is kept as their last error). Each that had started counts
        an attempt; one that reaches its `max_attempts` ends failed with a result instead.
        `replace_body`: store the sessions as given (a draining worker's, with the output they
        had generated in `resume_from`). Returns (requeued, failed); sessions no longer here
        are skipped."""
        if not sessions:
            return 0, 0
        k, b = self.keys, self.backend_id
        keys = [k.lease, k.heartbeat(b), k.ledger(b), k.ledger_sessions(b), k.admitted(b),
                k.events, k.results, k.settings, k.kv_seconds]
        for s in sessions:
            keys += [k.session(s.session_id), k.requeue(s.workload), k.body(s.session_id)]
        args = ["", b, repr(time.time() if now is None else now), why, "any",
                *(s.session_id for s in sessions)]
        if replace_body:
            args += [dump_body(s) for s in sessions]
        ((requeued, failed),) = self._runner.run(
            durable([ScriptCall("requeue", keys, args)], self.durability))
        return int(requeued), int(failed)


def _as_bytes(name: bytes | str) -> bytes:
    return name if isinstance(name, bytes) else name.encode()


class NotRegistered(RuntimeError):
    """The backend has no ledger (never registered, or its keys were lost): register again."""


class BackendReclaimed(RuntimeError):
    """The broker declared this backend dead; call `register` again, then carry on."""

    def __init__(self, backend_id: str) -> None:
        super().__init__(f"backend_id: {backend_id!r} was reclaimed after its heartbeat expired; "
                         "register again")
