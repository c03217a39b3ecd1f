"""The broker process: hold the lease, read the queues, ask the policy, apply its decision.

Event-driven: one XREADGROUP BLOCK over the pending and requeue streams of every workload plus
the events stream (heartbeats, finishes, cancels, reclaims XADD there), so the broker wakes on
any of them and never busy-polls. It blocks only when its last decision admitted nothing;
otherwise it reads without blocking and decides again.

Crash safety: the broker holds pending entries in its consumer-group backlog until the admit
script acks them in the same step that places the session, so a broker killed at any point
leaves each session either pending (entry unacked, state 'pending') or admitted (entry acked,
state 'admitted'), never both or neither. A broker taking over claims every backlog entry of the
group (XAUTOCLAIM, min idle 0: the lease guarantees the previous holder is gone) and carries on.

Redis outages: any outage error (see `broker.redis_conn`) ends the current term as active
broker; the process waits with backoff, logs once, and takes over again as soon as Redis
answers (its own lease if it is still there, else a fresh one), exactly as after a failover.
A backend counts as dead only when its heartbeat has been missing for `reap_grace_s` *while
this broker watched* Redis answer: heartbeat keys whose TTL ran out during an outage are not
a dead fleet.

Lost sessions: a session `running` on a live backend that the backend's heartbeats have not
listed for `orphan_after_s` (its worker lost it: a bug, a lost write) is requeued, an attempt
counted, so nothing stays `running` forever holding KV.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
import uuid
from collections.abc import Container, Iterator, Mapping
from dataclasses import dataclass
from itertools import chain, islice

from broker.completions import RECALL_COMPLETIONS, completion_from_entry
from broker.decision import LedgerEntry, apply_decision, touched_backends
from broker.episodes import due_releases
from broker.heartbeat import DEFAULT_HEARTBEAT_TTL_S, admits
from broker.keys import BROKER_GROUP, Keys
from broker import metrics
from broker.lease import Lease
from broker.policies import check_live_policy, make_policy
from broker.policies.base import Completion, Decision, PendingItem, Policy, Snapshot, serves
from broker.plans import Cmd, Runner, ScriptCall, durable
from broker.body import load_body
from broker.queue import (PendingEntry, SessionQueue, decode_entry, session_fit_error,
                          with_bodies)
from broker.redis_conn import Outage, connect, durability, is_outage
from broker.scripts import Scripts
from broker.session import SessionResult, SessionState
from broker.snapshot import (
    FleetRead,
    ResidentMeta,
    ViewCache,
    build_snapshot,
    live_limits,
    pending_item,
    planned_capacity,
    read_fleet,
    resident_meta,
)
from broker.streams import as_text, ensure_group, read_group
from broker.weights import WeightsState

log = logging.getLogger("rollout_broker.broker")

REQUEUE_CHUNK = 200  # sessions per requeue script call


def load_policy(spec: str) -> Policy:
    """A registered policy name, or `package.module:factory` for a policy outside the registry."""
    if ":" in spec:
        module, _, attr = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"policy: cannot load {spec!r}: {exc}") from None
        return factory()
    check_live_policy(spec)
    return make_policy(spec)


@dataclass(slots=True)
class BrokerSettings:
    lease_period_s: float = 5.0  # a standby takes over within 4/3 of this after a crash
    window: int = 1024  # pending items per workload shown to the policy, oldest first
    buffer: int = 4096  # pending entries per workload held in memory (and the group backlog)
    read_count: int = 2000  # entries per stream per read
    reap_grace_s: float = DEFAULT_HEARTBEAT_TTL_S  # watch a missing heartbeat this long first
    orphan_after_s: float = 15.0  # running, yet missing from its backend's beats this long
    orphan_check_s: float = 5.0  # how often to look for such sessions
    idle_check_s: float = 0.5  # how often to release the charge of episodes idle past their time


@dataclass(slots=True)
class _Held:
    entry: PendingEntry
    item: PendingItem


class BrokerService:
    def __init__(self, redis_url: str, namespace: str, policy: Policy,
                 settings: BrokerSettings | None = None, consumer: str | None = None) -> None:
        self.settings = settings or BrokerSettings()
        self.keys = Keys(namespace)
        self.policy = policy
        self.consumer = consumer or f"broker-{uuid.uuid4().hex[:12]}"
        self._client = connect(redis_url)
        self._durability = durability(redis_url)  # admissions wait for replicas
        self._outage = Outage(f"broker {self.consumer}", log)
        self._scripts = Scripts(self._client)
        self._runner = Runner(self._client, scripts=self._scripts)
        self._queue = SessionQueue(self._client, self.keys, self._scripts)
        self.lease = Lease(self._client, self.keys, self._scripts, self.settings.lease_period_s,
                           holder=f"{self.policy.name}@{self.consumer}")
        # The last completions-stream entry this policy object has learned from (kept across
        # lease terms: a broker that takes the lease back recalls only what it missed).
        self._learned_through: str | None = None
        self._reset_memory()
        self.admitted_total = 0  # sessions this process admitted (for benchmarks and logs)

    def _reset_memory(self) -> None:
        # Per workload, insertion-ordered: requeued entries (front) and pending entries (back).
        self._front: dict[str, dict[str, _Held]] = {}
        self._back: dict[str, dict[str, _Held]] = {}
        self._meta: dict[str, ResidentMeta] = {}
        self._placed_on: dict[str, str] = {}  # session -> backend, for those admitted here
        self._unreadable: set[str] = set()  # resident sessions whose state hash did not parse
        self._workloads: tuple[str, ...] = ()
        self._last_completion_id = "0-0"
        self._completions: list[Completion] = []  # read, not yet handed to the policy
        self._backend_ids: tuple[str, ...] = ()
        self._watch_since = time.monotonic()  # since when this term has seen Redis answer
        self._orphans_checked = time.monotonic()
        self._idle_checked = 0.0
        # Staleness and fit are checked once per held entry and rule: on entries held since the
        # last check, and on all of them when the version served, the bound or the live
        # fleet's limits change (`_expire_unrunnable`).
        self._unchecked: list[tuple[dict[str, _Held], _Held]] = []
        self._expiry_rules: tuple | None = None  # (stale rule, live limits) last checked
        self._views = ViewCache()  # ledgers, heartbeats and views read and built last time
        self._said_waiting: dict[str, float] = {}  # shared backend -> when `waiting_at` was set
        self._touched: set[str] = set()  # backends whose ledgers our own scripts changed
        self._meta_checked: dict[str, str | None] = {}  # ledger version whose sessions have meta
        self._meta_pruned = time.monotonic()

    # -- lifecycle ------------------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None) -> None:
        """Serve until `stop` is set: as the active broker while holding the lease, else standby.
        Rides out Redis outages (see the module docstring)."""
        stop = stop or threading.Event()
        active = metrics.ACTIVE.labels(self.policy.name)
        active.set(0)
        try:
            while not stop.is_set():
                try:
                    resuming = self.lease.held  # kept through an outage: no news to log
                    if not self.lease.try_acquire():
                        self._outage.ok()
                        stop.wait(self.lease.renew_interval_s)
                        continue
                    if not resuming:
                        log.info("broker %s: lease acquired, active", self.consumer)
                    active.set(1)
                    self._serve(stop)
                    active.set(0)
                    if not stop.is_set():
                        log.warning("broker %s: lease lost, back to standby", self.consumer)
                except Exception as exc:
                    active.set(0)
                    if not is_outage(exc):
                        raise
                    stop.wait(self._outage.failed(exc))
        finally:
            active.set(0)
            self._release_lease()
            self._client.close()

    def _release_lease(self) -> None:
        """Give the lease up on the way out; with Redis down it simply expires."""
        try:
            self.lease.release()
        except Exception as exc:
            self.lease.held = False
            log.warning("broker %s: lease not released (%s); it expires by itself",
                        self.consumer, type(exc).__name__)

    def _serve(self, stop: threading.Event) -> None:
        self._take_over()
        idle = False
        while not stop.is_set():
            if not self.lease.held or (self.lease.renew_due() and not self.lease.renew()):
                return
            fleet = self._sync(block=idle)
            if fleet is None:
                return
            self._outage.ok()  # a whole round worked: any outage is over
            idle = self._decide_and_apply(fleet) == 0

    # -- reading --------------------------------------------------------------------------------
    def _take_over(self) -> None:
        self._reset_memory()
        ensure_group(self._client, self.keys.events, BROKER_GROUP, start_id="$")
        last = self._client.xrevrange(self.keys.completions, count=1)
        self._last_completion_id = as_text(last[0][0]) if last else "0-0"
        self._recall()
        fleet = self._read_fleet()
        self._refresh_workloads(fleet.workloads)
        self._claim_queues()
        self._drop_stale_events()

    def _recall(self) -> None:
        """Hand the policy the completions it has not learned from, the last
        RECALL_COMPLETIONS of them: a restarted broker, a standby taking over or a new run in
        the namespace starts from what the namespace knows, not from the caps."""
        after = self._learned_through
        entries = self._client.xrevrange(self.keys.completions, min=f"({after}" if after else "-",
                                         count=RECALL_COMPLETIONS)
        if not entries:
            return
        self._learned_through = as_text(entries[0][0])
        history = [c for _, f in reversed(entries) if (c := completion_from_entry(f)) is not None]
        if history:
            self.policy.recall(history)
            log.info("recalled %d completions from %s", len(history), self.keys.completions)

    def _drop_stale_events(self) -> None:
        """Wake-ups a dead broker read but never acked: claim, ack and delete them (they only
        meant "look again", which a new broker does anyway), then forget idle consumers."""
        for entries in self._autoclaim(self.keys.events):
            ids = [e[0] for e in entries]
            if ids:
                pipe = self._client.pipeline(transaction=False)
                pipe.xack(self.keys.events, BROKER_GROUP, *ids)
                pipe.xdel(self.keys.events, *ids)
                pipe.execute()
        for stream in [self.keys.events] + [
                s for w in self._workloads for s in (self.keys.requeue(w), self.keys.pending(w))]:
            for c in self._client.xinfo_consumers(stream, BROKER_GROUP):
                name = as_text(c["name"])
                if name != self.consumer and int(c["pending"]) == 0:
                    self._client.xgroup_delconsumer(stream, BROKER_GROUP, name)

    def _claim_queues(self) -> None:
        """Claim every backlog entry of the queues and hold those not held yet: all of them on
        a takeover; after a queue read whose reply was lost (broker.redis_conn.single_attempt),
        the entries it delivered that never reached us. (Events it took only meant "look
        again", which the next round does.)"""
        held = {h.entry.entry_id for queues in (self._front, self._back)
                for queue in queues.values() for h in queue.values()}
        for w in self._workloads:
            for stream, front in ((self.keys.requeue(w), True), (self.keys.pending(w), False)):
                for entries in self._autoclaim(stream):
                    unseen = [e for e in entries if as_text(e[0]) not in held]
                    if unseen:
                        self._hold_claimed(stream, front, unseen)

    def _hold_claimed(self, stream: str, front: bool, entries: list[tuple[bytes, Mapping]]) -> None:
        bodied = with_bodies(self._client, self.keys, [f for _, f in entries])
        for (entry_id, _), fields in zip(entries, bodied):
            self._hold(stream, entry_id, fields, front)

    def _adopt_stranded(self) -> None:
        """Claim the queue entries in another consumer's pending list, and hold them as read.

        A broker cut off from Redis (a partition, not a crash) loses the lease while a read of
        its is in flight; TCP delivers that read when the path heals, after this broker took
        over and claimed the backlog, and Redis hands it entries that the old broker, standby
        by then, drops. The lease says no other broker acts, so whatever another consumer holds
        is stranded. Looked for every `orphan_check_s`."""
        queues = [(self.keys.requeue(w), True) for w in self._workloads] + \
                 [(self.keys.pending(w), False) for w in self._workloads]
        pipe = self._client.pipeline(transaction=False)
        for stream, _ in queues:
            pipe.xinfo_consumers(stream, BROKER_GROUP)
        for (stream, front), consumers in zip(queues, pipe.execute(raise_on_error=False)):
            if isinstance(consumers, Exception):
                continue  # (no such stream or group yet)
            for c in consumers:
                name = as_text(c["name"])
                if name == self.consumer or int(c["pending"]) == 0:
                    continue
                ids = [p["message_id"] for p in self._client.xpending_range(
                    stream, BROKER_GROUP, min="-", max="+", count=1000, consumername=name)]
                if not ids:
                    continue
                entries = self._client.xclaim(stream, BROKER_GROUP, self.consumer,
                                              min_idle_time=0, message_ids=ids)
                log.warning("broker %s: adopted %d entries of %s stranded with consumer %s",
                            self.consumer, len(entries), stream, name)
                self._hold_claimed(stream, front, entries)

    def _autoclaim(self, stream: str) -> Iterator[list[tuple[bytes, Mapping]]]:
        """Take over every backlog entry of the group on `stream`, a page at a time (min idle
        0: the lease guarantees the previous holder is gone). Ids whose entry was deleted
        meanwhile are acked here and not yielded."""
        start = "0-0"
        while True:
            reply = self._client.xautoclaim(stream, BROKER_GROUP, self.consumer,
                                            min_idle_time=0, start_id=start, count=1000)
            deleted = list(reply[2]) if len(reply) > 2 else []
            if deleted:
                self._client.xack(stream, BROKER_GROUP, *deleted)
            yield reply[1]
            start = as_text(reply[0])
            if start == "0-0":
                return

    def _refresh_workloads(self, workloads: tuple[str, ...]) -> None:
        if workloads != self._workloads:
            self._queue.ensure_broker_groups(workloads)
            for w in workloads:
                self._front.setdefault(w, {})
                self._back.setdefault(w, {})
            self._workloads = workloads

    def _hold(self, stream: str, entry_id: bytes | str, fields: Mapping, front: bool) -> None:
        eid = as_text(entry_id)
        if not fields:  # entry deleted after delivery (XDEL): nothing to place
            self._client.xack(stream, BROKER_GROUP, eid)
            return
        decoded = decode_entry(stream, eid, fields)
        if isinstance(decoded, str):
            log.warning("dead-letter %s %s: %s", stream, eid, decoded)
            self._queue.dead_letter(stream, eid, fields, decoded)
            return
        s = decoded.session
        enqueued_at = decoded.enqueued_at
        queue = (self._front if front else self._back).setdefault(s.workload, {})
        if s.session_id in self._front.get(s.workload, {}) or s.session_id in self._back.get(s.workload, {}):
            # A second live entry for one session (cannot come from our scripts); admit would
            # refuse it as not pending, so ack it now rather than hold it.
            self._client.xack(stream, BROKER_GROUP, eid)
            return
        held = queue[s.session_id] = _Held(entry=decoded, item=pending_item(s, enqueued_at))
        self._unchecked.append((queue, held))

    def _sync(self, block: bool) -> FleetRead | None:
        """Read new entries (blocking only if `block`), completions and the fleet; reap dead
        backends. None when the lease was lost."""
        streams: dict[str, str] = {self.keys.events: ">"}
        for w in self._workloads:
            streams[self.keys.requeue(w)] = ">"
            if len(self._back.get(w, ())) < self.settings.buffer:
                streams[self.keys.pending(w)] = ">"
        # (an idle wait ends when the lease is due for renewal: a full renewal interval from
        # here could come close to the lease's end once the round after it is slow)
        block_ms = max(1, int(self.lease.renew_in_s() * 1000)) if block else None
        try:
            reply = read_group(self._client, BROKER_GROUP, self.consumer, streams,
                               self.settings.read_count, block_ms)
        except Exception as exc:
            if not is_outage(exc):
                raise
            # (Redis still down: this raises too, and run() takes over again once it answers)
            self._claim_queues()
            reply = None
        events: list[bytes] = []
        read: list[tuple[str, bool, bytes]] = []
        fields_read: list[Mapping] = []
        for stream_b, entries in reply or []:
            stream = as_text(stream_b)
            if stream == self.keys.events:
                events = [e[0] for e in entries]
                continue
            front = stream.startswith(self.keys.prefix + "requeue:")
            for entry_id, fields in entries:
                read.append((stream, front, entry_id))
                fields_read.append(fields)
        # The entries carry ids; their bodies come in one more round trip for all of them.
        for (stream, front, entry_id), fields in zip(
                read, with_bodies(self._client, self.keys, fields_read)):
            self._hold(stream, entry_id, fields, front)
        fleet = self._read_fleet(events)
        self._refresh_workloads(fleet.workloads)
        if not self._reap_dead(fleet):
            return None
        self._load_meta(fleet)
        return fleet

    def _read_fleet(self, ack_events: list[bytes] | None = None) -> FleetRead:
        """The fleet in one round trip (two when a backend registered since the last read);
        new completions go to the policy."""
        fleet = read_fleet(self._client, self.keys, self._backend_ids, self._last_completion_id,
                           ack_events or (), self._views, self._touched)
        self._take_completions(fleet)
        if fleet.backend_index != self._backend_ids:
            self._backend_ids = fleet.backend_index
            fleet = read_fleet(self._client, self.keys, self._backend_ids, self._last_completion_id,
                               cache=self._views)
            self._take_completions(fleet)
        self._touched = set()
        return fleet

    def _take_completions(self, fleet: FleetRead) -> None:
        for entry_id, fields in fleet.completions:
            self._last_completion_id = entry_id
            c = completion_from_entry(fields)
            if c is not None:
                self._completions.append(c)
                self._meta.pop(c.session_id, None)
                self._placed_on.pop(c.session_id, None)

    def _load_meta(self, fleet: FleetRead) -> None:
        """Metadata of resident sessions this broker did not admit itself (after a takeover);
        forget sessions that left without a result (cancelled while admitted), every
        `orphan_check_s`. A ledger is looked through again only when its version moved."""
        now = time.monotonic()
        if now - self._meta_pruned >= self.settings.orphan_check_s:
            self._meta_pruned = now
            keep = {sid for led in fleet.ledgers.values() for sid in led.sessions}
            if len(self._meta) > len(keep & self._meta.keys()):  # some remembered ones left
                self._meta = {sid: m for sid, m in self._meta.items() if sid in keep}
                self._unreadable &= keep
            if len(self._placed_on) > len(keep & self._placed_on.keys()):
                self._placed_on = {sid: b for sid, b in self._placed_on.items() if sid in keep}
        missing: list[str] = []
        for b, led in fleet.ledgers.items():
            if led.version is not None and self._meta_checked.get(b) == led.version:
                continue
            missing += [sid for sid in led.sessions
                        if sid not in self._meta and sid not in self._unreadable]
            self._meta_checked[b] = led.version
        if not missing:
            return
        pipe = self._client.pipeline(transaction=False)
        for sid in missing:
            pipe.get(self.keys.body(sid))
            # ('session': the body of a session enqueued by an earlier version)
            pipe.hmget(self.keys.session(sid), "session", "admitted_at")
        replies = pipe.execute()
        for sid, body, (old_body, admitted_at) in zip(missing, replies[::2], replies[1::2]):
            try:
                self._meta[sid] = resident_meta(load_body(body or old_body or b""),
                                                float(admitted_at or 0.0))
            except (TypeError, ValueError):  # unreadable hash: the view leaves it out
                self._unreadable.add(sid)  # logged once, not re-read on every event
                log.error("session %s: state hash unreadable; left out of the policy view", sid)

    # -- recovery of dead backends and lost sessions ---------------------------------------------
    def _reap_dead(self, fleet: FleetRead) -> bool:
        now = time.monotonic()
        if now - self._watch_since < self.settings.reap_grace_s:
            return True  # a heartbeat missing now may have expired while Redis was down
        for b, led in fleet.ledgers.items():
            if fleet.heartbeats.get(b) is None and led.sessions:
                if not self._requeue(b, list(led.sessions),
                                     f"backend {b}: heartbeat gone (worker or engine down)",
                                     only_if_dead=True):
                    return False
        if now - self._idle_checked >= self.settings.idle_check_s:
            self._idle_checked = now
            if not self._release_idle():
                return False
        if now - self._orphans_checked >= self.settings.orphan_check_s:
            self._orphans_checked = now
            self._adopt_stranded()
            return self._requeue_orphans(fleet)
        return True

    def _release_idle(self) -> bool:
        """Release the KV charge of agent-driven episodes (broker/episodes.py) whose agent has
        made no call for the idle timeout, or whose call outlived its deadline (its gateway
        died): they are parked, and their next call is admitted again. False when the lease
        was lost."""
        k, now = self.keys, time.time()
        due = self._runner.run(due_releases(k, now))
        for sid, b in due:
            if b is None:  # no longer placed: the script drops its idle entry
                b = ""
            reply = as_text(self._scripts.episode_release(
                keys=[k.lease, k.session(sid), k.ledger(b) if b else k.mixture,
                      k.ledger_sessions(b) if b else k.mixture, k.idle, k.events],
                args=[self.lease.token, sid, b, repr(now)]))
            if reply == "lease":
                return False
            if reply == "released":
                self._touched.add(b)
                metrics.EPISODES_RELEASED.inc()
                log.info("episode %s: no call for its idle timeout; KV charge released on %s",
                         sid, b)
        return True

    def _requeue_orphans(self, fleet: FleetRead) -> bool:
        """Requeue sessions `running` on a live backend whose beats have not listed them for
        `orphan_after_s`: their worker does not run them any more."""
        cutoff = self.settings.orphan_after_s
        for b, led in fleet.ledgers.items():
            hb = fleet.heartbeats.get(b)
            if hb is None or hb.sent_at is None or not led.sessions:
                continue
            listed = {p.session_id for p in hb.sessions}
            # One admitted after the cutoff cannot have been running longer than it.
            since = hb.sent_at - cutoff
            unlisted = [sid for sid in led.sessions if sid not in listed
                        and (sid not in self._meta or self._meta[sid].admitted_at < since)]
            if not unlisted:
                continue
            pipe = self._client.pipeline(transaction=False)
            for sid in unlisted:
                pipe.hmget(self.keys.session(sid), "state", "running_at", "driver")
            # An agent's episode is run by its calls, not by the worker (its idle timeout
            # releases it: _release_idle).
            lost = [sid for sid, (state, running_at, driver) in zip(unlisted, pipe.execute())
                    if state == b"running" and running_at is not None and driver != b"agent"
                    and float(running_at) < hb.sent_at - cutoff]
            if lost:
                log.error("backend %s: %d sessions running there are not in its heartbeats "
                          "for %.0fs; requeueing them", b, len(lost), cutoff)
                if not self._requeue(b, lost, f"backend {b}: its worker no longer runs it",
                                     only_if_dead=False):
                    return False
        return True

    def _requeue(self, backend_id: str, sids: list[str], why: str, only_if_dead: bool) -> bool:
        """Take sessions back from `backend_id` under our lease (see lua/requeue.lua), only if
        its heartbeat is gone when `only_if_dead`. False when the lease was lost."""
        k = self.keys
        for start in range(0, len(sids), REQUEUE_CHUNK):
            chunk = sids[start:start + REQUEUE_CHUNK]
            pipe = self._client.pipeline(transaction=False)
            for sid in chunk:
                pipe.hget(k.session(sid), "workload")
            workloads = [as_text(w) if w else None for w in pipe.execute()]
            keys = [k.lease, k.heartbeat(backend_id), k.ledger(backend_id),
                    k.ledger_sessions(backend_id), k.admitted(backend_id), k.events, k.results,
                    k.settings, k.kv_seconds]
            args: list = [self.lease.token, backend_id, repr(time.time()), why,
                          "dead" if only_if_dead else "any"]
            for sid, w in zip(chunk, workloads):
                # A session hash without a workload cannot be requeued; the script still
                # releases its reservation (the requeue key is then never written).
                keys += [k.session(sid), k.requeue(w or "unknown"), k.body(sid)]
                args.append(sid)
            self._touched.add(backend_id)
            reply = self._scripts.requeue(keys=keys, args=args)
            if as_text(reply) == "lease":
                return False
            if as_text(reply) == "alive":
                return True
            requeued, failed = (int(x) for x in reply)
            metrics.REQUEUED.labels("dead_backend" if only_if_dead else "lost").inc(requeued)
            log.warning("%s; requeued %d sessions, %d out of attempts", why, requeued, failed)
        return True

    # -- deciding -------------------------------------------------------------------------------
    def _pending_view(self, paused_adapters: Container[str] = frozenset()) -> dict[str, list[PendingItem]]:
        """Each workload's first `window` pending items, but for those of a paused adapter
        (an adapter-only weight update: they wait for its resume)."""
        out = {}
        n = self.settings.window
        for w in self._workloads:
            held = chain(self._front.get(w, {}).values(), self._back.get(w, {}).values())
            if paused_adapters:
                held = (h for h in held if h.item.adapter not in paused_adapters)
            out[w] = [h.item for h in islice(held, n)]
        return out

    def _find(self, sid: str) -> tuple[dict[str, _Held], _Held] | None:
        for table in (self._front, self._back):
            for queue in table.values():
                held = queue.get(sid)
                if held is not None:
                    return queue, held
        return None

    def _decide_and_apply(self, fleet: FleetRead) -> int:
        weights = fleet.weights
        if weights.paused:
            return 0  # a weight update: nothing is admitted until resume (its event wakes us)
        self._expire_unrunnable(weights, fleet)
        pending = self._pending_view(weights.paused_adapters)
        completions, self._completions = self._completions, []
        self._learned_through = self._last_completion_id  # (what was read is handed over now)
        if not any(pending.values()) and not completions:
            return 0
        now = time.time()
        snap = build_snapshot(now, pending, fleet, self._meta, completions, self._views)
        t0 = time.perf_counter()
        decision = self.policy.decide(snap)
        metrics.DECIDE.observe(time.perf_counter() - t0)
        self._say_waiting(snap, decision, now)
        return self._apply(decision, fleet, now)

    def _say_waiting(self, snap: Snapshot, decision: Decision, now: float) -> None:
        """On engines other namespaces share, say in the backend's ledger (`waiting_at`) that
        this namespace has sessions pending there, at most once a second per backend: its
        worker then keeps this namespace's guaranteed share from the others
        (broker/shares.py). Sessions this decision admits do not count."""
        shared = [v for v in snap.backends if v.shared and v.healthy
                  and now - self._said_waiting.get(v.backend_id, 0.0) >= 1.0]
        if not shared:
            return
        placed = {a.session_id for a in decision.admissions}
        left = [item for items in snap.pending.values() for item in items
                if item.session_id not in placed]
        waiting = [v.backend_id for v in shared if any(serves(v, item) for item in left)]
        if not waiting:
            return
        pipe = self._client.pipeline(transaction=False)
        for b in waiting:
            pipe.hset(self.keys.ledger(b), "waiting_at", repr(now))
            self._said_waiting[b] = now
        pipe.execute()

    def _expire_unrunnable(self, weights: WeightsState, fleet: FleetRead) -> None:
        """Pending sessions that must not wait end failed with the reason, before any policy
        sees them, so that none holds back the sessions behind it:
        - stale: more than the staleness bound behind the version the engines serve (unless
          they asked to run on current weights);
        - unfit: a new session whose first request cannot fit any live backend
          (`session_fit_error`; only judged while some backend is live).
        New entries are checked once; every held entry again when the bound, the version or
        the live fleet's limits change."""
        unchecked, self._unchecked = self._unchecked, []
        stale_rule = (weights.version, weights.max_staleness) \
            if weights.max_staleness is not None and weights.version is not None else None
        fit_rule = live_limits(fleet)
        if (stale_rule, fit_rule) != self._expiry_rules:  # every held entry again
            self._expiry_rules = (stale_rule, fit_rule)
            unchecked = [(queue, held) for table in (self._front, self._back)
                         for queue in table.values() for held in queue.values()]
        if stale_rule is None and fit_rule is None:
            return
        expired = []
        for queue, held in unchecked:
            if queue.get(held.item.session_id) is not held:
                continue
            s = held.entry.session
            why = None
            if stale_rule is not None and s.on_stale == "fail" and weights.is_stale(s.policy_version):
                why = (f"stale: enqueued for policy version {s.policy_version}, the engines serve "
                       f"{weights.version} and max_staleness is {weights.max_staleness}")
            elif fit_rule is not None:
                why = session_fit_error(s, fit_rule)
            if why is not None:
                expired.append((queue, held, why))
        if expired:
            self._expire(expired)

    def _expire(self, expired: list[tuple[dict[str, _Held], _Held, str]]) -> None:
        """End these pending sessions failed with their reasons (one pipeline)."""
        k, now = self.keys, time.time()
        pipe = self._client.pipeline(transaction=False)
        for _, held, why in expired:
            s = held.entry.session
            result = SessionResult(session_id=s.session_id, workload=s.workload,
                                   group_id=s.group_id, group_size=s.group_size,
                                   status=SessionState.failed, error=why,
                                   finished_at=now, policy_version=s.policy_version)
            self._scripts.expire(keys=[k.lease, k.session(s.session_id), held.entry.stream,
                                       k.results, k.settings, k.body(s.session_id),
                                       k.kv_seconds],
                                 args=[self.lease.token, s.session_id, held.entry.entry_id,
                                       repr(now), result.model_dump_json(), why],
                                 client=pipe)
        for (queue, held, why), reply in zip(expired, pipe.execute()):
            r = as_text(reply)
            if r == "lease":
                self.lease.held = False
                return
            queue.pop(held.item.session_id, None)
            if r == "ok":
                log.info("session %s: not admitted: %s", held.item.session_id, why)

    def _apply(self, decision: Decision, fleet: FleetRead, now: float) -> int:
        """Plan with the shared rule (`broker.decision.apply_decision`: α, then recharges, then
        admissions) against the ledger just read, then send what it accepted, in that order,
        in one pipeline; the scripts apply the same rule atomically to the ledger as it is by
        then (finishes since the read only make room). They count as applied once the
        connection's replicas hold them (else NotReplicatedError, an outage: this term ends
        and the next one reads what Redis kept)."""
        k, token = self.keys, self.lease.token
        # A router baseline forwards everything and lets the engine queue: the ledger charges
        # its sessions but does not hold them back, or the baseline would be secretly admitted.
        enforce = not self.policy.dispatch_on_arrival
        # Only the ledgers the decision can touch (copied: the plan charges them), not a copy
        # and an index of every resident session on every loop.
        def charged_on(sid: str) -> str | None:
            b = self._placed_on.get(sid)
            led = fleet.ledgers.get(b) if b is not None else None
            return b if led is not None and sid in led.sessions else None

        touched, unknown = touched_backends(decision, charged_on)
        if unknown:  # admitted by an earlier broker (or moved): look them up
            touched.update(b for b, led in fleet.ledgers.items()
                           if any(sid in led.sessions for sid in unknown))
        ledgers = {b: LedgerEntry(capacity_tokens=planned_capacity(led, fleet.heartbeats.get(b)),
                                  alpha=led.alpha,
                                  sessions=dict(led.sessions),
                                  healthy=admits(fleet.heartbeats.get(b)),
                                  reserved_tokens=led.reserved_tokens)
                   for b, led in fleet.ledgers.items() if b in touched}
        for adm in decision.admissions:
            if self._find(adm.session_id) is None or adm.backend_id not in ledgers:
                log.error("policy %s admitted %s to %s: unknown session or backend",
                          self.policy.name, adm.session_id, adm.backend_id)
        plan = apply_decision(decision, ledgers, enforce)
        calls: list[Cmd | ScriptCall] = []
        for b, alpha in plan.alpha.items():
            calls.append(Cmd("hset", (k.ledger(b), "alpha", repr(alpha))))
        for sid, (b, tokens) in plan.recharge.items():
            calls.append(ScriptCall("recharge",
                                    [k.lease, k.session(sid), k.ledger(b), k.ledger_sessions(b)],
                                    [token, sid, b, tokens, "1" if enforce else "0"]))
        placed: list[tuple[dict[str, _Held], _Held, str]] = []
        for adm in plan.admissions:
            found = self._find(adm.session_id)
            if found is None:
                continue
            queue, held = found
            b = adm.backend_id
            # An agent's episode is announced to the gateways, not handed to the worker.
            handoff = k.episodes_admitted if held.entry.session.driver == "agent" else \
                k.admitted(b)
            calls.append(ScriptCall(
                "admit",
                [k.lease, k.session(adm.session_id), k.ledger(b), k.ledger_sessions(b),
                 k.heartbeat(b), handoff, held.entry.stream],
                [token, adm.session_id, b, int(adm.reserved_tokens), held.entry.entry_id,
                 repr(now), "1" if enforce else "0"]))
            placed.append((queue, held, b))
        self._touched.update(b for b, _ in plan.recharge.values())
        self._touched.update(adm.backend_id for adm in plan.admissions)
        replies = self._runner.run(durable(calls, self._durability))
        admitted = 0
        for (queue, held, b), reply in zip(placed, replies[-len(placed):] if placed else []):
            r = as_text(reply)
            sid = held.item.session_id
            if r == "ok":
                queue.pop(sid, None)
                self._meta[sid] = resident_meta(held.entry.session, now)
                self._placed_on[sid] = b
                admitted += 1
                metrics.ADMISSIONS.labels(held.item.workload).inc()
                metrics.QUEUE_WAIT.labels(held.item.workload).observe(
                    max(0.0, now - held.item.enqueued_at))
            elif r == "not_pending":  # cancelled or placed before: its entry is acked now
                queue.pop(sid, None)
            elif r == "lease":
                self.lease.held = False
                break
            # 'no_capacity' / 'unhealthy' / 'no_backend': the session stays pending.
        self.admitted_total += admitted
        return admitted
