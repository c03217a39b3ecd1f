"""The trainer's client: enqueue sessions, set the mixture, read results, cancel, status.

Usable from any process given a Redis URL and a namespace. Results are read through consumer
group "trainer" under a stable consumer name: a batch handed back by `results()` is acked (and
counted in `consumed`) when the next `results()` call starts, or on `ack()` / `close()`. A
trainer that crashes before that gets the same batch again after restart; once acked, a result
is never delivered again, and the finish script publishes at most one result per session, so
each session reaches the trainer exactly once. A results entry that cannot be read is moved to
the dead-letter stream with the reason; the readable ones are returned.

A Redis outage is ridden out: each call waits with backoff (logged once per outage) and goes
on when Redis answers, for up to `outage_timeout_s`, then raises the Redis error. Every call
is safe to repeat, so a call whose reply was lost is simply made again; `enqueue` then reports
the ids it added in the lost attempt as known, not new. With a Sentinel URL, enqueue, the
delivery of results and their acknowledgement count only once a replica holds them
(`broker.plans.durable`); a read whose delivery was not confirmed (or whose reply was lost) is
followed by a read of this consumer's backlog, so no result stays behind.

`RolloutClient` blocks; `AsyncRolloutClient` runs the same plans (broker/plans.py) on a
`redis.asyncio` connection.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from typing import Any, Literal, TypeVar

from pydantic import ValidationError

from broker.episodes import close_episode, episode_base_url, episode_spec, forget, open_episode
from broker.keys import TRAINER_GROUP, Keys
from broker.adapters import AdapterRecord, check_adapter
from broker.adapters import read_all as read_adapters
from broker.adapters import register as register_adapter
from broker.ledger import EnqueueLimits, enqueue_limits, read_all
from broker.mixture import quotas
from broker.plans import (AsyncRunner, Cmd, Guard, Plan, Runner, ScriptCall, batch, cmd, durable,
                          ensure_group, script)
from broker.queue import dead_letter, enqueue, validate_batch
from broker.redis_conn import NO_WAIT, Outage, connect, connect_async, durability, is_outage
from broker.session import DEFAULT_WORKLOADS, Session, SessionResult
from broker.streams import BacklogCursor, as_text
from broker.weights import (
    WeightsState,
    order_pause,
    order_pause_adapter,
    order_resume,
    order_resume_adapter,
    order_staleness,
    read_state,
    wait_paused,
)

MIXTURE_TOLERANCE = 1e-6
DEFAULT_OUTAGE_TIMEOUT_S = 300.0

log = logging.getLogger("rollout_broker.client")
T = TypeVar("T")


def _entry_order(entry_id: str) -> tuple[int, ...]:
    """A stream entry id ('ms-seq') as a sortable key: completion order."""
    return tuple(int(x) for x in entry_id.split("-"))


class _Plans:
    """What both clients hold and do, as plans (broker/plans.py): the namespace's keys, the
    delivery buffer and its acknowledgements, the groups this client enqueued. No I/O here;
    `RolloutClient` and `AsyncRolloutClient` run these plans on their own connection."""

    def __init__(self, namespace: str, workloads: Iterable[str] | None, consumer: str,
                 outage_timeout_s: float) -> None:
        self.keys = Keys(namespace)
        self.consumer = consumer
        self.outage_timeout_s = outage_timeout_s
        self._outage = Outage(f"client {namespace}/{consumer}", log)
        self.durability = NO_WAIT  # the connection's (`redis_conn.durability`)
        names = list(workloads or ())
        for w in names:
            self.keys.pending(w)  # validates the name
        self._seed_names = names
        self._cursor = BacklogCursor()  # our deliveries from before a restart come first
        self._buffer: dict[str, deque[tuple[str, SessionResult]]] = {}  # delivered, not handed
        self._handed: list[tuple[str, str]] = []  # (entry id, workload) handed back, not acked
        self._mixture_seen: dict[str, float] = {}  # the last mixture read (quota in an outage)
        self._groups: dict[str, set[str]] = {}  # group id -> its sessions this client enqueued
        self.filtered_groups = 0  # whole groups `group_filter` turned away (acknowledged)

    def _retry(self, plan: Callable[..., Plan[T]], *args: Any) -> Guard:
        """A step: `plan(*args)`, waiting out a Redis outage of up to `outage_timeout_s`."""
        return Guard(plan, args, deadline=time.monotonic() + self.outage_timeout_s)

    def _retried(self, plan: Callable[..., Plan[T]], *args: Any) -> Plan[T]:
        return (yield self._retry(plan, *args))

    @staticmethod
    def _until(deadline: float, plan: Callable[..., Plan[T]], *args: Any) -> Guard:
        """A step: `plan(*args)`, waiting out an outage until the monotonic `deadline`; None
        if Redis did not answer by then."""
        return Guard(plan, args, deadline=deadline, quiet=True)

    def _setup(self) -> Plan[None]:
        if self._seed_names:
            yield cmd("sadd", self.keys.workloads, *self._seed_names)
        elif not (yield cmd("exists", self.keys.workloads)):
            yield cmd("sadd", self.keys.workloads, *DEFAULT_WORKLOADS)
        yield from ensure_group(self.keys.results, TRAINER_GROUP)

    def _known_workloads(self) -> Plan[set[str]]:
        known = {as_text(w) for w in (yield cmd("smembers", self.keys.workloads))}
        if not known:  # a new namespace, or a Redis that came back without its data
            yield from self._setup()
            known = {as_text(w) for w in (yield cmd("smembers", self.keys.workloads))}
        return known

    # -- enqueue and configuration --------------------------------------------------------------
    def _known_and_limits(self) -> Plan[tuple[set[str], EnqueueLimits]]:
        return (yield from self._known_workloads()), (yield from enqueue_limits(self.keys))

    def _enqueue(self, items: list[Session | Mapping[str, Any]]) -> Plan[list[str]]:
        known, limits = yield self._retry(self._known_and_limits)
        batch = validate_batch(items, known, limits)
        new = yield self._retry(enqueue, self.keys, batch, None, self.durability)
        for s in batch:
            if s.group_id is not None:
                self._groups.setdefault(s.group_id, set()).add(s.session_id)
        return new

    def _set_mixture(self, mixture: Mapping[str, float]) -> Plan[dict[str, float]]:
        known = yield self._retry(self._known_workloads)
        if not mixture:
            raise ValueError("mixture: give at least one workload share")
        for w, p in mixture.items():
            if w not in known:
                raise ValueError(f"mixture.{w}: unknown workload; known: {', '.join(sorted(known))}")
            if isinstance(p, bool) or not (isinstance(p, int | float) and math.isfinite(p)
                                           and p >= 0):
                raise ValueError(f"mixture.{w}: share {p!r} must be a finite number ≥ 0")
        total = sum(mixture.values())
        if abs(total - 1.0) > MIXTURE_TOLERANCE:
            raise ValueError(f"mixture: shares sum to {total}, not 1")
        clean = {w: float(p) / total for w, p in mixture.items()}
        yield self._retry(self._write_mixture, clean)
        return clean

    def _write_mixture(self, clean: dict[str, float]) -> Plan[None]:
        yield batch([Cmd("delete", (self.keys.mixture,)),
                     Cmd("hset", (self.keys.mixture,),
                         {"mapping": {w: repr(p) for w, p in clean.items()}})],
                    transaction=True)

    def _read_mixture(self) -> Plan[dict[str, float]]:
        fields = yield cmd("hgetall", self.keys.mixture)
        self._mixture_seen = {as_text(k): float(v) for k, v in fields.items()}
        return self._mixture_seen

    # -- results --------------------------------------------------------------------------------
    def _ack_once(self) -> Plan[None]:
        if not self._handed:
            return
        args: list[str] = [TRAINER_GROUP]
        for eid, w in self._handed:
            args += [eid, w]
        yield from durable([ScriptCall("ack_results", [self.keys.results, self.keys.consumed],
                                       args)], self.durability)
        self._handed = []

    def _fetch(self, count: int, block_ms: int | None) -> Plan[int]:
        start, block = self._cursor.read_args(block_ms)
        read = Cmd("xreadgroup", (TRAINER_GROUP, self.consumer, {self.keys.results: start}),
                   {"count": count, "block": block}, once=True)
        try:
            # Delivery is a write too: results are handed on only once replicas hold them
            # (and their delivery), so a failover never brings a handed result back.
            (reply,) = yield from durable([read], self.durability)
        except Exception as exc:
            if is_outage(exc):
                # Entries this read delivered may never have reached us (lost reply) or not
                # be confirmed: read our backlog again from the start, so none stays behind.
                self._cursor.reset()
            raise
        entries = reply[0][1] if reply else []
        self._cursor.advance(entries, count)
        # A backlog read delivers again what we hold; so would a '>' read on a primary that
        # lost a delivery it confirmed (`durable`): an entry enters the buffer once.
        held = self._held_ids() if entries else set()
        n = 0
        for entry_id, fields in entries:
            eid = as_text(entry_id)
            if not fields or eid in held:  # deleted after delivery, or already ours
                continue
            raw = fields.get(b"result", fields.get("result"))
            try:
                if raw is None:
                    raise ValueError("entry has no 'result' field")
                r = SessionResult.model_validate_json(raw)
            except ValueError as exc:  # pydantic's ValidationError is a ValueError
                reason = (f"result does not validate: {exc.errors()[0]['msg']}"
                          if isinstance(exc, ValidationError) else str(exc))
                log.error("results entry %s dead-lettered: %s", eid, reason)
                yield from dead_letter(self.keys, self.keys.results, eid, fields, reason,
                                       group=TRAINER_GROUP)
                continue
            self._buffer.setdefault(r.workload, deque()).append((eid, r))
            n += 1
        return n

    def _held_ids(self) -> set[str]:
        """Entry ids buffered or handed back and not yet acknowledged (a backlog read after
        an outage delivers them again)."""
        return {eid for q in self._buffer.values() for eid, _ in q} | {
            eid for eid, _ in self._handed}

    def _buffered(self) -> int:
        return sum(len(q) for q in self._buffer.values())

    def _results(self, batch_size: int, mode: str, timeout: float, by_group: bool,
                 group_filter: Callable[[list[SessionResult]], bool] | None
                 ) -> Plan[list[SessionResult]]:
        if batch_size <= 0:
            raise ValueError(f"batch_size: {batch_size} must be positive")
        if mode not in ("fifo", "quota"):
            raise ValueError(f"mode: {mode!r} must be 'fifo' or 'quota'")
        if by_group and mode != "fifo":
            raise ValueError("by_group: whole groups are delivered in fifo mode only")
        if group_filter is not None and not by_group:
            raise ValueError("group_filter: filters whole groups; pass by_group=True")
        deadline = time.monotonic() + timeout
        yield self._until(deadline, self._ack_once)
        want = None
        if mode == "quota":
            mixture = yield self._until(deadline, self._read_mixture)
            want = quotas(batch_size, mixture if mixture is not None else self._mixture_seen)
            if not want:
                raise ValueError("mode: quota needs a mixture; call set_mixture first")
        while not (self._groups_ready(batch_size, group_filter) if by_group
                   else self._satisfied(batch_size, want)):
            left = deadline - time.monotonic()
            if left <= 0 or (yield self._until(deadline, self._fetch, max(batch_size, 100),
                                               min(int(left * 1000), 1000) or 1)) is None:
                break
        picked = (self._take_groups(batch_size, group_filter) if by_group
                  else self._take(batch_size, want))
        state = (yield self._until(deadline, read_state, self.keys)) if picked else None
        if state is not None and state.max_staleness is not None:
            for r in picked:
                r.stale = state.is_stale(r.oldest_version)
        return picked

    def _satisfied(self, batch_size: int, want: dict[str, int] | None) -> bool:
        if want is None:
            return self._buffered() >= batch_size
        return all(len(self._buffer.get(w, ())) >= n for w, n in want.items())

    def _complete_groups(self) -> list[list[tuple[str, SessionResult]]]:
        """Buffered groups with every member in, ordered by when their last member finished."""
        members: dict[str, list[tuple[str, SessionResult]]] = {}
        for q in self._buffer.values():
            for e in q:
                r = e[1]
                members.setdefault(r.group_id or f"\0{r.session_id}", []).append(e)
        done = [m for m in members.values() if len(m) >= m[0][1].group_size]
        return sorted(done, key=lambda m: max(_entry_order(eid) for eid, _ in m))

    def _groups_ready(self, batch_size: int,
                      keep: Callable[[list[SessionResult]], bool] | None) -> bool:
        if keep is not None:
            self._drop_groups(keep)
        return sum(len(m) for m in self._complete_groups()) >= batch_size

    def _drop_groups(self, keep: Callable[[list[SessionResult]], bool]) -> None:
        """Complete groups `keep` turns away leave the buffer as acknowledged (consumed)."""
        dropped = [m for m in self._complete_groups() if not keep([r for _, r in m])]
        if dropped:
            self._release_from_buffer([e for m in dropped for e in m])
            self.filtered_groups += len(dropped)

    def _release_from_buffer(self, entries: list[tuple[str, SessionResult]]) -> None:
        chosen = {eid for eid, _ in entries}
        for w, q in self._buffer.items():
            self._buffer[w] = deque(e for e in q if e[0] not in chosen)
        self._handed += [(eid, r.workload) for eid, r in entries]

    def _take_groups(self, batch_size: int,
                     keep: Callable[[list[SessionResult]], bool] | None) -> list[SessionResult]:
        if keep is not None:
            self._drop_groups(keep)
        picked: list[tuple[str, SessionResult]] = []
        for m in self._complete_groups():
            if picked and len(picked) + len(m) > batch_size:
                break
            picked += sorted(m, key=lambda e: _entry_order(e[0]))
        self._release_from_buffer(picked)
        return [r for _, r in picked]

    def _take(self, batch_size: int, want: dict[str, int] | None) -> list[SessionResult]:
        picked: list[tuple[str, SessionResult]] = []
        if want is None:
            picked = sorted((e for q in self._buffer.values() for e in q),
                            key=lambda e: _entry_order(e[0]))[:batch_size]
        else:
            for w, n in want.items():
                picked += list(self._buffer.get(w, ()))[:n]
        self._release_from_buffer(picked)
        return [r for _, r in picked]

    # -- weight updates -------------------------------------------------------------------------
    def _pause(self, mode: str, timeout: float) -> Plan[list[str]]:
        epoch = yield self._retry(order_pause, self.keys, mode)
        return (yield self._retry(wait_paused, self.keys, epoch, timeout))

    def _pause_adapter(self, name: str, mode: str, timeout: float) -> Plan[list[str]]:
        epoch = yield self._retry(order_pause_adapter, self.keys, name, mode)
        return (yield self._retry(wait_paused, self.keys, epoch, timeout))

    # -- cancel and status ----------------------------------------------------------------------
    def _cancel_groups(self, group_ids: list[str]) -> Plan[dict[str, str]]:
        out: dict[str, str] = {}
        for gid in group_ids:
            members = self._groups.get(gid)
            if members is None:
                raise ValueError(f"group_id: {gid!r} was not enqueued by this client")
            for sid in sorted(members):
                out[sid] = yield self._retry(self._cancel, sid)
        return out

    def _set_session_retention(self, seconds: float) -> Plan[None]:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
                or not math.isfinite(seconds) or seconds < 1:
            raise ValueError(f"session_retention_s: must be a number of seconds >= 1, "
                             f"not {seconds!r}")
        yield cmd("hset", self.keys.settings, "session_retention_s", repr(float(seconds)))

    # -- episodes the agent drives (broker/episodes.py, gateway/) ---------------------------------
    def _open_episode(self, fields: Mapping[str, Any], gateway_url: str) -> Plan[str]:
        spec = episode_spec(fields)
        known = yield self._retry(self._known_workloads)
        if spec.workload not in known:
            raise ValueError(f"workload: {spec.workload!r} is not one of the namespace's "
                             f"workloads {sorted(known)}")
        if not (yield self._retry(open_episode, self.keys, spec)):
            raise ValueError(f"session_id: {spec.session_id!r} is already used in namespace "
                             f"{self.keys.namespace!r}")
        if spec.group_id is not None:
            self._groups.setdefault(spec.group_id, set()).add(spec.session_id)
        return episode_base_url(gateway_url, spec.session_id)

    def _close_episode(self, episode_id: str, reward: float | None) -> Plan[str]:
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                                   or not math.isfinite(reward)):
            raise ValueError(f"reward: must be a finite number or None, not {reward!r}")
        return (yield self._retry(close_episode, self.keys, episode_id,
                                  None if reward is None else float(reward)))

    def _set_episode_idle_timeout(self, seconds: float) -> Plan[None]:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
                or not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"episode_idle_timeout_s: must be a positive number of seconds, "
                             f"not {seconds!r}")
        yield cmd("hset", self.keys.settings, "episode_idle_timeout_s", repr(float(seconds)))

    def _cancel(self, session_id: str) -> Plan[str]:
        k = self.keys
        for _ in range(5):
            backend = yield cmd("hget", k.session(session_id), "backend")
            b = as_text(backend) if backend else None
            keys = [k.session(session_id)]
            if b:
                keys += [k.ledger(b), k.ledger_sessions(b), k.admitted(b)]
            else:  # not on a backend: the ledger keys are never touched; any of ours will do
                keys += [k.mixture, k.mixture, k.mixture]
            keys += [k.events, k.control, k.settings, k.body(session_id)]
            reply = as_text((yield script("cancel", keys,
                                          [session_id, b or "", repr(time.time())])))
            if reply == "cancelled":  # an agent's episode: its records go too (else a no-op)
                yield from forget(self.keys, session_id)
            if reply != "retry":
                return reply
        raise RuntimeError(f"session_id: {session_id!r} kept moving between backends; retry")

    def _status(self) -> Plan[dict[str, Any]]:
        k = self.keys
        workloads = sorted((yield from self._known_workloads()))
        replies = yield batch([Cmd("xlen", (s,)) for w in workloads
                               for s in (k.pending(w), k.requeue(w))]
                              + [Cmd("hgetall", (k.consumed,)), Cmd("xlen", (k.results,)),
                                 Cmd("xlen", (k.dead_letter,))])
        n = 2 * len(workloads)
        ledgers = yield from read_all(k)
        alive = yield batch([Cmd("exists", (k.heartbeat(b),)) for b in ledgers])
        mixture = yield from self._read_mixture()
        return {
            "pending": {w: int(replies[2 * i]) + int(replies[2 * i + 1])
                        for i, w in enumerate(workloads)},
            "consumed": {as_text(a): int(v) for a, v in replies[n].items()},
            "results_unacknowledged": int(replies[n + 1]),
            "dead_letter": int(replies[n + 2]),
            "mixture": mixture,
            "backends": {
                b: {"healthy": bool(h), "capacity_tokens": s.capacity_tokens,
                    "alpha": s.alpha, "reserved_tokens": s.reserved_tokens,
                    "sessions": len(s.sessions), "max_model_len": s.max_model_len}
                for (b, s), h in zip(ledgers.items(), alive)
            },
        }


class RolloutClient(_Plans):
    """The trainer's client on a blocking Redis connection (see the module's docstring)."""

    def __init__(self, redis_url: str, namespace: str, workloads: Iterable[str] | None = None,
                 consumer: str = "trainer",
                 outage_timeout_s: float = DEFAULT_OUTAGE_TIMEOUT_S) -> None:
        """`workloads` adds names to the namespace's known workloads; a namespace with none yet
        starts with the defaults (rlvr, rlhf, agentic). `outage_timeout_s`: how long a call
        waits for Redis to answer before it raises."""
        super().__init__(namespace, workloads, consumer, outage_timeout_s)
        self._client = connect(redis_url)
        self.durability = durability(redis_url)
        self._runner = Runner(self._client, self._outage)
        self._runner.run(self._retried(self._setup))

    def close(self) -> None:
        self.ack()
        self._client.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def known_workloads(self) -> set[str]:
        return self._runner.run(self._retried(self._known_workloads))

    def enqueue(self, sessions: Iterable[Session | Mapping[str, Any]]) -> list[str]:
        """Validate the whole batch, then add it; returns the ids that were new.

        A bad item rejects the batch before anything is written (ValueError naming the item
        and field), so nothing is half-enqueued. Re-enqueueing a known id is a no-op.
        """
        return self._runner.run(self._enqueue(list(sessions)))

    def set_mixture(self, mixture: Mapping[str, float]) -> dict[str, float]:
        """Set the target share π_w of consumed sessions per workload; must sum to 1 ± 1e-6."""
        return self._runner.run(self._set_mixture(mixture))

    def mixture(self) -> dict[str, float]:
        return self._runner.run(self._retried(self._read_mixture))

    def ack(self) -> None:
        """Acknowledge every result handed back so far (count it as consumed)."""
        self._runner.run(self._retried(self._ack_once))

    def results(self, batch_size: int, mode: Literal["fifo", "quota"] = "fifo",
                timeout: float = 10.0, by_group: bool = False,
                group_filter: Callable[[list[SessionResult]], bool] | None = None
                ) -> list[SessionResult]:
        """Up to `batch_size` results; fewer only if `timeout` seconds pass first.

        `fifo`: in completion order. `quota`: batch_size·π_w of each workload (largest
        remainders); results beyond a workload's quota wait in the client for later batches.
        `by_group` (fifo only): whole GRPO groups, never part of one: groups in the order their
        last member finished, as many as fit in `batch_size` (a group larger than it comes
        alone); members of unfinished groups wait in the client. A session without a group is a
        group of one. (A cancelled member publishes no result: its group never completes.)
        `group_filter` (with `by_group`): a whole group it returns False for is acknowledged
        and never handed over (counted in `filtered_groups`), e.g. DAPO's dynamic sampling,
        "the rewards of the group are not all equal". Over-sample by enqueueing more groups
        than a batch needs, then `cancel_groups` the surplus once the batch is full.
        A Redis outage only delays results, within `timeout`: the previous batch's
        acknowledgement then waits for the next call (until then a restarted trainer would get
        that batch again, as if it had crashed before acknowledging it).
        """
        return self._runner.run(self._results(batch_size, mode, timeout, by_group, group_filter))

    def stream(self, batch_size: int, mode: Literal["fifo", "quota"] = "fifo",
               timeout: float = 10.0, by_group: bool = False,
               group_filter: Callable[[list[SessionResult]], bool] | None = None
               ) -> Iterator[list[SessionResult]]:
        """`results(...)` batch after batch, for a training loop: `for batch in
        client.stream(64): ...`. A batch is acknowledged when the next one is asked for (as
        with `results`); `timeout` bounds each wait, and a wait that brings nothing yields
        nothing. Endless: break out of the loop to stop."""
        while True:
            batch = self.results(batch_size, mode, timeout, by_group, group_filter)
            if batch:
                yield batch

    def pause(self, mode: str = "keep", timeout: float = 30.0) -> list[str]:
        """Stop generation for a weight update (broker/weights.py): admission stops and every
        live worker pauses its engine with vLLM's `mode` (`abort`, `wait` or `keep`). Returns
        once all of them have, with their backend ids; TimeoutError names any that did not."""
        return self._runner.run(self._pause(mode, timeout))

    def resume(self, version: int) -> int:
        """Generation goes on with the weights of policy `version` (the trainer has loaded
        them): engines resume, outputs from now on carry `version`, admission restarts."""
        return self._runner.run(self._retried(order_resume, self.keys, version))

    def pause_adapter(self, name: str, mode: str = "keep", timeout: float = 30.0) -> list[str]:
        """Pause what serves LoRA adapter `name` for an adapter-only weight update
        (broker/weights.py): its pending sessions wait, and the engines that have it loaded
        pause with vLLM's `mode`; everything else runs on. Register the new weights with
        `register_adapter(name, path)`, then `resume_adapter(name)`. Returns once every live
        worker has acknowledged, with their backend ids."""
        return self._runner.run(self._pause_adapter(name, mode, timeout))

    def resume_adapter(self, name: str) -> bool:
        """End adapter `name`'s pause: the paused engines load its registered weights in place
        and resume, and its sessions are admitted again. False if it was not paused."""
        return self._runner.run(self._retried(order_resume_adapter, self.keys, name))

    def set_max_staleness(self, max_staleness: int | None) -> None:
        """Bound how many policy versions behind the engines' a session may be: a pending one
        further behind is not admitted (its `on_stale` says whether it fails or runs on the
        current weights), and a result whose oldest tokens are further behind is handed over
        with `stale=True`. None: no bound."""
        self._runner.run(self._retried(order_staleness, self.keys, max_staleness))

    def set_session_retention(self, seconds: float) -> None:
        """Keep an ended session's state (`GET /sessions/<id>`; a repeated id refused at
        enqueue) for `seconds` after it ends, from now on (default 3600). Its body and its
        acknowledged result are not kept at all (docs/reliability.md: What Redis keeps)."""
        self._runner.run(self._retried(self._set_session_retention, seconds))

    def weights(self) -> WeightsState:
        """Whether generation is paused (and how), and the policy version engines serve."""
        return self._runner.run(self._retried(read_state, self.keys))

    def cancel_groups(self, group_ids: Iterable[str]) -> dict[str, str]:
        """Cancel every session of these groups that has not finished (running ones stop on
        their engines): the surplus of an over-sampled batch. Groups are the ones this client
        enqueued. Returns each session's `cancel` outcome."""
        return self._runner.run(self._cancel_groups(list(group_ids)))

    def open_episode(self, episode: Mapping[str, Any], gateway_url: str = "") -> str:
        """Open an episode the agent drives through the session gateway (`rollout-broker
        gateway`): `episode` holds a session's fields without a prompt (`session_id`,
        `workload`, `group_id`, `group_size`, `max_tokens` per call, `max_turns` calls,
        `sampling`, `policy_version`, `metadata`). Returns its base URL under `gateway_url`
        (`{gateway_url}/sessions/{id}/v1`): the agent's OpenAI client calls it as is. Its
        result arrives like any session's once `close_episode` names its reward."""
        return self._runner.run(self._open_episode(episode, gateway_url))

    def close_episode(self, episode_id: str, reward: float | None) -> str:
        """End the episode and publish its one result (its calls as turns, token-exact) with
        `reward`: 'ok', or the state it had ended in ('done', 'failed', 'cancelled'), or
        'unknown'."""
        return self._runner.run(self._close_episode(episode_id, reward))

    def set_episode_idle_timeout(self, seconds: float) -> None:
        """How long an episode's agent may go without a call before the broker releases its
        KV charge (its next call is admitted again); 30 s by default."""
        self._runner.run(self._retried(self._set_episode_idle_timeout, seconds))

    def register_adapter(self, name: str, path: str) -> int:
        """Register LoRA adapter `name`, loaded by the engines from `path` (PEFT's layout: what
        vLLM's `/v1/load_lora_adapter` reads; the path as the engines see it). Sessions name it
        in `Session.adapter`. Registering it again with new weights at a new path is an
        adapter-only weight update: each worker loads them before the adapter's next request.
        Returns its version (1, then +1 per registration)."""
        check_adapter(name, path)
        return self._runner.run(self._retried(register_adapter, self.keys, name, path))

    def adapters(self) -> dict[str, AdapterRecord]:
        """The registered LoRA adapters, by name."""
        return self._runner.run(self._retried(read_adapters, self.keys))

    def cancel(self, session_id: str) -> str:
        """'cancelled', or the state that made it too late ('done', 'failed', 'cancelled',
        'dead_lettered'), or 'unknown'. A cancelled session publishes no result."""
        return self._runner.run(self._retried(self._cancel, session_id))

    def status(self) -> dict[str, Any]:
        return self._runner.run(self._retried(self._status))


class AsyncRolloutClient(_Plans):
    """`RolloutClient`'s methods, awaitable, on a `redis.asyncio` connection.

    The same plans run on both (the rules live once), so acks, buffering and exactly-once
    delivery are the sync client's. Nothing blocks a thread: a `results()` waiting for a batch
    never holds up an `enqueue`, a `pause` or a `status`. Reading results (`results`,
    `stream`, `ack`) goes one call at a time: a batch is acknowledged when the next is asked
    for. The namespace is set up on the first call.
    """

    def __init__(self, redis_url: str, namespace: str, workloads: Iterable[str] | None = None,
                 consumer: str = "trainer",
                 outage_timeout_s: float = DEFAULT_OUTAGE_TIMEOUT_S) -> None:
        super().__init__(namespace, workloads, consumer, outage_timeout_s)
        self._client = connect_async(redis_url)
        self.durability = durability(redis_url)
        self._runner = AsyncRunner(self._client, self._outage)
        self._set_up = False
        self._reading = asyncio.Lock()  # the delivery buffer and its acknowledgements

    async def _run(self, plan: Plan[T]) -> T:
        if not self._set_up:
            await self._runner.run(self._retried(self._setup))
            self._set_up = True
        return await self._runner.run(plan)

    async def known_workloads(self) -> set[str]:
        return await self._run(self._retried(self._known_workloads))

    async def enqueue(self, sessions: Iterable[Session | Mapping[str, Any]]) -> list[str]:
        return await self._run(self._enqueue(list(sessions)))

    async def set_mixture(self, mixture: Mapping[str, float]) -> dict[str, float]:
        return await self._run(self._set_mixture(dict(mixture)))

    async def mixture(self) -> dict[str, float]:
        return await self._run(self._retried(self._read_mixture))

    async def ack(self) -> None:
        async with self._reading:
            await self._run(self._retried(self._ack_once))

    async def results(self, batch_size: int, mode: Literal["fifo", "quota"] = "fifo",
                      timeout: float = 10.0, by_group: bool = False,
                      group_filter: Callable[[list[SessionResult]], bool] | None = None
                      ) -> list[SessionResult]:
        async with self._reading:
            return await self._run(self._results(batch_size, mode, timeout, by_group,
                                                 group_filter))

    async def stream(self, batch_size: int, mode: Literal["fifo", "quota"] = "fifo",
                     timeout: float = 10.0, by_group: bool = False,
                     group_filter: Callable[[list[SessionResult]], bool] | None = None
                     ) -> AsyncIterator[list[SessionResult]]:
        """`async for batch in client.stream(64): ...` (see `RolloutClient.stream`)."""
        while True:
            batch = await self.results(batch_size, mode, timeout, by_group, group_filter)
            if batch:
                yield batch

    async def pause(self, mode: str = "keep", timeout: float = 30.0) -> list[str]:
        return await self._run(self._pause(mode, timeout))

    async def resume(self, version: int) -> int:
        return await self._run(self._retried(order_resume, self.keys, version))

    async def pause_adapter(self, name: str, mode: str = "keep",
                            timeout: float = 30.0) -> list[str]:
        return await self._run(self._pause_adapter(name, mode, timeout))

    async def resume_adapter(self, name: str) -> bool:
        return await self._run(self._retried(order_resume_adapter, self.keys, name))

    async def set_max_staleness(self, max_staleness: int | None) -> None:
        await self._run(self._retried(order_staleness, self.keys, max_staleness))

    async def set_session_retention(self, seconds: float) -> None:
        await self._run(self._retried(self._set_session_retention, seconds))

    async def weights(self) -> WeightsState:
        return await self._run(self._retried(read_state, self.keys))

    async def cancel_groups(self, group_ids: Iterable[str]) -> dict[str, str]:
        return await self._run(self._cancel_groups(list(group_ids)))

    async def cancel(self, session_id: str) -> str:
        return await self._run(self._retried(self._cancel, session_id))

    async def register_adapter(self, name: str, path: str) -> int:
        check_adapter(name, path)
        return await self._run(self._retried(register_adapter, self.keys, name, path))

    async def adapters(self) -> dict[str, AdapterRecord]:
        return await self._run(self._retried(read_adapters, self.keys))

    async def open_episode(self, episode: Mapping[str, Any], gateway_url: str = "") -> str:
        return await self._run(self._open_episode(episode, gateway_url))

    async def close_episode(self, episode_id: str, reward: float | None) -> str:
        return await self._run(self._close_episode(episode_id, reward))

    async def set_episode_idle_timeout(self, seconds: float) -> None:
        await self._run(self._retried(self._set_episode_idle_timeout, seconds))

    async def status(self) -> dict[str, Any]:
        return await self._run(self._retried(self._status))

    async def close(self) -> None:
        await self.ack()
        await self._client.aclose()

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
