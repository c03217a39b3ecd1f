"""MISA-T's admission: steps 4 and 5 of `misa_t.py`, one `AdmissionRound` per decide() call.

The round starts from the book's `Accounted` (the backends' states, KV charged per workload):
follow-up turns go home first; each workload gets its share σ_w of Σ_b α_b·C_b
(misa_t_control.shares); then, most under-served workload first, each workload's oldest session
(with the rest of its GRPO group) goes where `Placement.choose` puts it, until every workload
has placed everything or its oldest fits nowhere. A blocked, under-served workload keeps the
backend closest to fitting its oldest for itself within the call. An oldest session tied to a
model or an adapter blocks only the backends it may run on: the sessions behind it place on
the others (each engine's own queue would let them, behind a router).

A session that names a model or a LoRA adapter places only where the engine serves it
(`base.serves`), and with an adapter only where one of the engine's `max_loras` slots is free
or already holds it; among those, engines that already hold or have loaded the adapter come
first (no load, no slot taken). A session that no live backend can serve, or whose adapter has
no slot anywhere now, waits without holding back the sessions behind it (vLLM's scheduler
lets requests whose adapters fit go ahead of one whose adapter does not).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from broker.policies.base import (
    Admission,
    Decision,
    PendingItem,
    Snapshot,
    adapters_in_use,
    serves,
)
from broker.policies.misa_t_book import Accounted
from broker.policies.misa_t_charges import Predictions, Residency
from broker.policies.misa_t_control import CompletionPacer, admissible, shares
from broker.policies.misa_t_placement import BackendState, Hits, Placement, Pool
from broker.policies.misa_t_prefix import PrefixIndex, PrefixKey, prefix_key

if TYPE_CHECKING:
    from broker.policies.misa_t import Call, MisaTConfig

_TURN = operator.attrgetter("turn")


class PrefixKeys:
    """The prefix keys of pending items, by session (or GRPO group), kept across calls: an
    item waits through many calls and its key is the same in each.

    Two generations, so memory follows what is still asked for, not everything ever placed:
    once `generation` keys are new, the older generation goes; a key asked for again moves to
    the new one (a head still waiting, the next member of a group)."""

    def __init__(self, generation: int = 4096) -> None:
        self.generation = generation
        self._new: dict[str, PrefixKey] = {}
        self._old: dict[str, PrefixKey] = {}

    def __len__(self) -> int:
        return len(self._new) + len(self._old)

    def of(self, item: PendingItem) -> PrefixKey:
        cache_id = item.group_id if item.group_id is not None else item.session_id
        key = self._new.get(cache_id)
        if key is None:
            key = self._old.pop(cache_id, None)
            if key is None:
                key = prefix_key(item.prefix)
            if len(self._new) >= self.generation:
                self._old, self._new = self._new, {}
            self._new[cache_id] = key
        return key


@dataclass(slots=True)
class AdmissionRound:
    """One call's admissions into `decision` (the placement's states and `accounted.used` are
    updated as it places)."""

    config: MisaTConfig
    predictions: Predictions
    residency: Residency
    prefix: PrefixIndex
    keys: PrefixKeys
    call: Call
    accounted: Accounted
    decision: Decision
    running: int = -1  # sessions running on the healthy backends, growing with each placement
    # Per backend id: the adapters its sessions hold, with this call's placements (made on
    # first use: only calls that place adapter sessions pay for it).
    adapters: dict[str, set[str]] | None = None
    kv_to_spare: bool = False  # every first turn waiting fits in the caches' free KV (`run`)

    def __post_init__(self) -> None:
        self.running = self.accounted.running

    def run(self, snapshot: Snapshot) -> None:
        fresh = self._send_follow_ups_home(snapshot.pending)
        if not fresh:
            return
        cfg = self.config
        self.kv_to_spare = cfg.prefix_placement and self._all_fit(fresh)
        quota: dict[str, float] = {}
        pacer = None
        if cfg.workload_allocation:
            kv_seconds = self.predictions.kv_seconds(fresh, snapshot.mixture_target)
            sigma = shares(snapshot.mixture_target, kv_seconds, snapshot.consumed,
                           cfg.deficit_gain)
            quota = {w: s * self.accounted.limit_total for w, s in sigma.items()}
            pacer = self._pacer(snapshot, fresh)
        self._fill(fresh, quota, pacer)

    def _send_follow_ups_home(
        self, pending: Mapping[str, Sequence[PendingItem]]
    ) -> dict[str, Sequence[PendingItem]]:
        """Place follow-up turns (router mode) on their home backends first, whatever the
        limits say (their history is cached there); returns each workload's first turns."""
        fresh: dict[str, Sequence[PendingItem]] = {}
        by_id: dict[str, BackendState] | None = None
        for w, items in pending.items():
            if any(map(_TURN, items)):
                placement, used = self.accounted.placement, self.accounted.used
                if by_id is None:
                    by_id = {b.view.backend_id: b for b in placement.backends}
                for item in items:
                    if item.turn and item.home_backend in by_id:
                        charge = self.predictions.charge(item)
                        home = by_id[item.home_backend]
                        self._place(item, home, charge)
                        placement.placed(home)
                        used[w] = used.get(w, 0.0) + charge
                items = tuple(item for item in items if not item.turn)
            if items:
                fresh[w] = items
        return fresh

    def _all_fit(self, fresh: Mapping[str, Sequence[PendingItem]]) -> bool:
        """Whether the first turns waiting would all fit in the KV the healthy backends' caches
        have free (their own size, whatever α allows), each workload's charged as its oldest
        is: then no session of this call waits for KV, and blocks a shared prompt saves are
        not scarce."""
        demand = sum(len(items) * self.predictions.charge(items[0]) for items in fresh.values())
        free = 0.0
        for b in self.accounted.placement.backends:
            free += max(0.0, b.view.capacity_tokens - b.reserved)
        return demand <= free

    def _fill(self, fresh: Mapping[str, Sequence[PendingItem]], quota: Mapping[str, float],
              pacer: CompletionPacer | None) -> None:
        """Admit, most under-served workload first (oldest first across workloads without
        allocation), each workload oldest first, until nothing more fits."""
        cfg, used, placement = self.config, self.accounted.used, self.accounted.placement
        cursor = dict.fromkeys(fresh, 0)
        live = set(fresh)  # the workloads with sessions still to place
        held: dict[str, BackendState] = {}  # workload -> the backend kept for its blocked oldest
        # Per workload: the backends a session of it that fit nowhere could have used; nothing
        # behind that session may place there in this call (FIFO on those backends).
        blocked: dict[str, list[BackendState]] = {}
        pools: dict[str, Pool] = {}  # per workload: backends neither held for another nor blocked
        while live:
            if cfg.workload_allocation:
                # A workload whose oldest session fits nowhere right now does not hold the
                # others back (work conservation): only workloads still placing count.
                allowed = admissible(live, used, quota)
                w = min(allowed, key=lambda v: (used.get(v, 0.0) / max(quota.get(v, 0.0), 1e-9), v))
                if pacer is not None and pacer.ahead(w):
                    live.discard(w)  # its completions would crowd the next batches
                    continue
            else:
                w = min(live, key=lambda v: (fresh[v][cursor[v]].enqueued_at, v))
            pool = pools.get(w)
            if pool is None:
                pool = pools[w] = placement.pool(
                    [b for v, b in held.items() if v != w] + blocked.get(w, []))
            items, where = fresh[w], None
            while cursor[w] < len(items):
                where = self._where(items[cursor[w]], pool)
                if where is not None:
                    break
                cursor[w] += 1  # no backend serves it or has an adapter slot: the rest go on
            if where is None:
                live.discard(w)
                continue
            taken, charged, need = self._admit_next(items, cursor[w], where)
            if not taken:
                # Its oldest fits nowhere it may run: nothing behind it overtakes it there. A
                # session that may run anywhere stops the workload; one tied to a model or an
                # adapter leaves the backends it could not use to the sessions behind it, as
                # their engines' own queues would behind a router.
                if self._hold_for(w, quota, where, need, held):
                    pools.clear()
                if len(where.members) == len(pool.members):
                    live.discard(w)
                    continue
                blocked.setdefault(w, []).extend(where.members)
                pools.pop(w, None)
                cursor[w] += 1
                if cursor[w] >= len(items):
                    live.discard(w)
                continue
            used[w] = used.get(w, 0.0) + charged
            cursor[w] += taken
            if pacer is not None:
                pacer.admitted(w, taken)
            if cursor[w] >= len(fresh[w]):
                live.discard(w)

    def _hold_for(self, w: str, quota: Mapping[str, float], pool: Pool, need: float,
                  held: dict[str, BackendState]) -> bool:
        """Under-served and blocked: keep the backend closest to fitting `w`'s oldest (most
        headroom) for it, so the room freed there accumulates instead of going to smaller
        sessions of other workloads, which would starve it for good (EASY backfilling's
        reservation for the queue head). Elsewhere lending goes on. `pool`: the backends the
        oldest may run on. True if one is kept (one per workload and call: its oldest)."""
        cfg = self.config
        if not (cfg.workload_allocation and cfg.hold_for_blocked and w not in held
                and self.accounted.used.get(w, 0.0) < quota.get(w, 0.0)):
            return False
        keep = self.accounted.placement.most_room(pool, need)
        if keep is None:
            return False
        held[w] = keep
        return True

    def _pacer(
        self, snapshot: Snapshot, fresh: Mapping[str, Sequence[PendingItem]]
    ) -> CompletionPacer | None:
        """The mixture pacer for this call, or None when pacing is off."""
        if self.config.pace_tolerance == math.inf:
            return None
        in_flight: dict[str, int] = {}
        for view in snapshot.backends:
            for s in view.sessions:
                in_flight[s.workload] = in_flight.get(s.workload, 0) + 1
        duration = self.predictions.durations(snapshot.mixture_target, fresh)
        return CompletionPacer.start(snapshot.mixture_target, self.config.pace_tolerance,
                                     duration, in_flight, self.config.pace_scope)

    def _admit_next(self, items: Sequence[PendingItem], start: int,
                    pool: Pool) -> tuple[int, float, float]:
        """Admit the item at `start` (with the rest of its GRPO group) to `pool`, the backends
        that may take it (`_where`): (how many, KV charged, the charge of the item at
        `start`)."""
        head = items[start]
        need = self.predictions.charge(head)
        if not self.accounted.placement.fits(pool, need):
            return 0, 0.0, need  # (the usual end of a workload's turn in a call: no lookups)
        group = [head]
        if head.group_id is not None and head.group_size > 1:
            for it in items[start + 1 : start + head.group_size]:
                if (it.group_id != head.group_id or it.turn > 0 or it.model != head.model
                        or it.adapter != head.adapter):
                    break
                group.append(it)
        taken, charged = self._place_group(group, need, pool)
        return taken, charged, need

    def _place_group(self, group: list[PendingItem], need: float,
                     pool: Pool) -> tuple[int, float]:
        """Place the members in order (the first charged `need`) until one fits nowhere:
        (how many, KV charged).

        The first placement puts the group's prefix in the index, so the rest follow it to
        that backend while its decode batch stays within the balance slack, and spill to the
        next one (one more prefill of the shared prompt) beyond it."""
        placement, head = self.accounted.placement, group[0]
        key = self.keys.of(head) if self.config.prefix_placement else None
        hits = (placement.hits(self.prefix.matches(key))
                if key is not None and key.hashes else None)
        taken, charged = 0, 0.0
        fed: dict[str, float] = {}  # per backend: KV tokens the group's placements allocate there
        predict = self.predictions
        # Where KV is to spare, a cached prefix shorter than a member's learned output saves
        # less prefill than following it piles decode on one engine (a sync step waits for
        # that engine): it does not count. Where sessions wait for KV, the prompt's shared
        # blocks are what is scarce, and every match counts; so it does while lengths are not
        # learned (charged at their cap).
        min_hit = 0.0
        if key is not None and self.kv_to_spare:
            min_hit = predict.learned_output(head) or 0.0
        for it in group:
            ch = need if it is head or predict.same_charge(it, head) else predict.charge(it)
            if it is not head and it.adapter is not None:
                pool = self._eligible(it, pool)  # the head's placement may have taken a slot
            target, hit = self._choose(pool, ch, hits, min_hit)
            if target is None:
                break
            self._place(it, target, ch)
            placement.placed(target)
            if key is not None:
                b = target.view.backend_id
                fed[b] = fed.get(b, 0.0) + max(0.0, ch - hit)
            if hits is not None:
                # The target now holds the whole key, stamped newest; nothing else changed
                # for it: what `self.prefix.matches(key)` would now say.
                placement.key_placed(hits, target, key.tokens[-1])
            taken, charged = taken + 1, charged + ch
        # Nothing reads the index until the group is placed: one insert per backend it went to
        # leaves it as one per member would (the same churn, the same newest stamps).
        for b, tokens in fed.items():
            self.prefix.insert(key, b, tokens)
        return taken, charged

    def _choose(self, pool: Pool, charge: float, hits: Hits | None,
                min_hit: float = 0.0) -> tuple[BackendState | None, int]:
        """The backend for `charge` tokens, and how much of the key of `hits` it probably
        caches: balance first (KV use, then running sessions), then the longest cached prefix,
        then headroom (misa_t_placement.py)."""
        cfg = self.config
        run_slack = max(cfg.balance_slack_sessions,
                        cfg.balance_slack_frac * self.running / self.accounted.healthy)
        return self.accounted.placement.choose(pool, charge, hits, run_slack, min_hit)

    def _place(self, item: PendingItem, target: BackendState, charge: float) -> None:
        """Admit `item` to `target` (`_place_group` records in the prefix index where it placed
        each group)."""
        target.reserved += charge
        target.running += 1
        self.running += 1
        if item.adapter is not None:
            self._in_use(target).add(item.adapter)
        self.decision.admissions.append(Admission(item.session_id, target.view.backend_id,
                                                  int(charge)))
        self.residency.admitted(item, charge, self.call.now)

    # -- models and LoRA adapters ------------------------------------------------------------
    def _where(self, item: PendingItem, pool: Pool) -> Pool | None:
        """The backends of `pool` that may take `item` (`_eligible`; all of them for a session
        naming no model or adapter), or None where none serves it or, for an adapter, has a
        slot for it now. Such a session waits without holding back the sessions behind it, as
        vLLM's scheduler lets the requests behind one whose adapter has no slot go ahead; one
        that fits nowhere for its KV holds back the sessions behind it on these backends
        (`_fill`)."""
        if not _needs(item):
            return pool
        eligible = self._eligible(item, pool)
        return eligible if eligible.members else None

    def _in_use(self, b: BackendState) -> set[str]:
        if self.adapters is None:
            self.adapters = {}
        held = self.adapters.get(b.view.backend_id)
        if held is None:
            held = self.adapters[b.view.backend_id] = adapters_in_use(b.view)
        return held

    def _eligible(self, item: PendingItem, pool: Pool) -> Pool:
        """The backends of `pool` that may take `item`: serving its model, and for an adapter
        with a slot for it. Where the adapter is held or loaded somewhere in there and fits,
        only those: a session placed there needs no load and takes no new slot."""
        adapter, placement = item.adapter, self.accounted.placement
        if adapter is None:
            return placement.restrict(pool, lambda b: serves(b.view, item))
        ready, slot = [], []
        for b in pool.members:
            if not serves(b.view, item):
                continue
            held = self._in_use(b)
            if adapter in held:
                ready.append(b)
            elif len(held) < b.view.max_loras:
                (ready if adapter in b.view.adapters else slot).append(b)
        charge = self.predictions.charge(item)
        if ready:
            first = placement.subset(ready)
            if placement.fits(first, charge):
                return first
        return placement.subset(ready + slot)


def _needs(item: PendingItem) -> bool:
    """Whether `item` restricts where it may run (a model or an adapter of its own)."""
    return item.model is not None or item.adapter is not None
