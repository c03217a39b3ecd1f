"""Where MISA-T puts each admission of one decide() call: the backend choice, kept cheap at
hundreds of backends.

The rule (`Placement.choose`): among the backends of the pool whose reservations still fit the
charge under α·C, keep those within `locality_slack` of the least-utilised (reserved over the
cache's own size), and of those the ones within `run_slack` sessions of the least loaded in
running sessions; pick the longest cached-prefix match, then the most headroom, then the first
in fleet order. A match shorter than the caller's `min_hit` does not count (MISA-T sets it
where following a short shared prompt would pile decode on one engine and save nothing
scarce: misa_t_admission.py).

It runs once per admission, a hundred or more times per call at a few hundred backends. Two
evaluations of the same rule: loops over the pool's backends (cheapest for small fleets), and,
from `ARRAY_MIN_BACKENDS` up, NumPy arrays of the call's reservations and running counts,
updated in place on each placement, so a choice costs a few vector operations over the fleet
instead of three Python passes. The arrays outlive the call: the next one `sync`s only the
backends that moved (a new α or cache size, reservations set back from the ledger), so a call
where a few backends changed does not rebuild them over the fleet. Most choices follow one
made for the same charge on the same pool with nothing changed since but that placement (a
GRPO group's members, the next group of a workload): the masks of the last choice are then
updated at the one backend that moved, and only the minima the rule is relative to are
looked up again where that backend held one (`_Last`).
tests/broker/policies/test_misa_t_placement.py checks that both evaluations choose the same
backend on every step of random calls, and that a synced placement chooses as a new one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from broker.policies.base import BackendView

# Reductions by index: x[x.argmin()] is the minimum in a quarter of the time np.minimum.reduce
# takes on these arrays (0.23 against 0.90 µs at 144 elements), m[m.argmax()] whether any is set
# in a sixth of m.any()'s. (Callers check that x is not empty.)
def _lowest(x: np.ndarray) -> float:
    return x[x.argmin()]


def _highest(x: np.ndarray) -> float:
    return x[x.argmax()]


def _any(mask: np.ndarray) -> bool:
    return bool(mask[mask.argmax()])


ARRAY_MIN_BACKENDS = 64  # measured 2026-12-07 (benchmarks/policy_cost.py steady, each path
# forced, three runs each): median decide() 1.30-1.57 ms in loops and 1.04-1.07 ms in arrays
# at 64 backends, about equal at 32, arrays 1.5-2× faster from 96 (results/misa-t.md §16)


@dataclass(slots=True)
class _Last:
    """The last array choice, for the next one on the same pool and charge: which backend, its
    KV use and running count when chosen, and the minima and running cut-off it was chosen
    against (`Placement._choose_arrays`). `placed` is set when that backend's placement came
    in and nothing else has moved since; any other change to the arrays drops the record."""

    pool: Pool
    charge: float
    index: int
    util: float
    running: float
    low: float
    least: float
    cut: int
    placed: bool = False


@dataclass(slots=True)
class BackendState:
    """A backend's working state in a decide() call (MisaT keeps the object across calls and
    sets it back from its accounting where anything moved)."""

    view: BackendView
    limit: float  # α_b·C_b
    reserved: float
    running: int  # sessions with a request on the engine, including those placed in this call

    @property
    def headroom(self) -> float:
        return self.limit - self.reserved


@dataclass(slots=True)
class Pool:
    """The backends one workload may place on in this call (all but those held for others)."""

    members: list[BackendState]  # shared with the Placement when nothing is excluded: read only
    # The same set over the fleet's order (array evaluation); None: every backend.
    mask: np.ndarray | None = None


@dataclass(slots=True)
class Hits:
    """For one prefix key: the tokens of it each backend probably caches (backend id -> tokens,
    as `PrefixIndex.matches` gives them), and the same over the fleet's order as an array when
    the placement evaluates arrays. Made once per GRPO group; `Placement.key_placed` records
    each member's placement, so the group's later members need no new prefix lookup."""

    by_id: dict[str, int]
    array: np.ndarray | None = None


class Placement:
    """The healthy backends and the choice rule over them. MisaT keeps one across calls while
    the fleet is the same backends in the same order, and `sync`s the states that moved."""

    def __init__(self, backends: Sequence[BackendState], locality_slack: float,
                 use_arrays: bool | None = None) -> None:
        self.backends = list(backends)
        self.locality_slack = locality_slack
        if use_arrays is None:
            use_arrays = len(self.backends) >= ARRAY_MIN_BACKENDS
        self._arrays = use_arrays
        if use_arrays:
            self._index = {b.view.backend_id: i for i, b in enumerate(self.backends)}
            self._position = {id(b): i for i, b in enumerate(self.backends)}
            self._limit = np.array([b.limit for b in self.backends], dtype=np.float64)
            self._reserved = np.array([b.reserved for b in self.backends], dtype=np.float64)
            self._capacity = np.array([b.view.capacity_tokens for b in self.backends],
                                      dtype=np.float64)
            self._util = self._reserved / self._capacity
            self._room = self._limit - self._reserved
            # (Counts as floats: comparing them with a float cut-off then needs no conversion.)
            self._running = np.array([b.running for b in self.backends], dtype=np.float64)
            n = len(self.backends)  # scratch masks, reused by every choice of the call
            self._fits, self._near, self._candidate, self._best, self._scratch = (
                np.empty(n, dtype=bool) for _ in range(5))
            self._last: _Last | None = None

    def pool(self, excluded: Sequence[BackendState] = ()) -> Pool:
        if not excluded:  # the whole fleet (the common case): no copy, no mask
            return Pool(self.backends)
        gone = {id(o) for o in excluded}
        members = [b for b in self.backends if id(b) not in gone]
        if not self._arrays:
            return Pool(members)
        mask = np.ones(len(self.backends), dtype=bool)
        for o in excluded:
            mask[self._position[id(o)]] = False
        return Pool(members, mask)

    def restrict(self, pool: Pool, keep: Callable[[BackendState], bool]) -> Pool:
        """The backends of `pool` for which `keep` holds."""
        return self.subset([b for b in pool.members if keep(b)])

    def subset(self, members: list[BackendState]) -> Pool:
        """A pool of exactly `members` (states of this placement)."""
        if not self._arrays:
            return Pool(members)
        mask = np.zeros(len(self.backends), dtype=bool)
        for b in members:
            mask[self._position[id(b)]] = True
        return Pool(members, mask)

    def placed(self, b: BackendState) -> None:
        """`b`'s reservation and running count changed (a placement on it), or its limit."""
        if self._arrays:
            i = self._position[id(b)]
            last = self._last
            if last is not None:
                if last.index == i and not last.placed:
                    last.placed = True
                else:
                    self._last = None
            self._reserved[i] = b.reserved
            self._util[i] = b.reserved / self._capacity[i]
            self._limit[i] = b.limit
            self._room[i] = b.limit - b.reserved
            self._running[i] = b.running

    def sync(self, moved: Sequence[BackendState]) -> None:
        """Take in the current values of `moved` (any of a backend's limit, reservation, running
        count or cache size), so that the placement stays in use over the same backends across
        decide() calls; states it does not hold are ignored."""
        if self._arrays:
            self._last = None
            for b in moved:
                i = self._position.get(id(b))
                if i is not None:
                    self._capacity[i] = b.view.capacity_tokens
                    self.placed(b)  # (the room from the new limit)

    def hits(self, matched: Mapping[str, int]) -> Hits:
        """`matched` (backend id -> cached tokens of one prefix) in the form `choose` reads."""
        hits = Hits(dict(matched))
        if self._arrays:
            hits.array = np.zeros(len(self.backends), dtype=np.float64)
            for backend_id, tokens in matched.items():
                i = self._index.get(backend_id)
                if i is not None:
                    hits.array[i] = tokens
        return hits

    def key_placed(self, hits: Hits, b: BackendState, tokens: int) -> None:
        """The key of `hits` was just placed on `b`, which now caches `tokens` of it."""
        hits.by_id[b.view.backend_id] = tokens
        if hits.array is not None:
            hits.array[self._position[id(b)]] = tokens

    def fits(self, pool: Pool, charge: float) -> bool:
        """Whether some backend of `pool` has room for `charge` tokens (else `choose` finds none)."""
        if self._arrays:
            return _any(self._fitting(pool, charge, self._scratch))
        return any(b.limit - b.reserved >= charge for b in pool.members)

    def most_room(self, pool: Pool, charge: float) -> BackendState | None:
        """The backend of `pool` with the most headroom among those whose limit is at least
        `charge` (the first in fleet order of equals); None when no limit is that large."""
        if not self._arrays:
            best, room = None, -math.inf
            for b in pool.members:
                if b.limit >= charge and b.limit - b.reserved > room:
                    best, room = b, b.limit - b.reserved
            return best
        big = np.greater_equal(self._limit, charge, out=self._scratch)
        if pool.mask is not None:
            big &= pool.mask
        if not _any(big):
            return None
        return self.backends[int(np.where(big, self._room, -np.inf).argmax())]

    def _fitting(self, pool: Pool, charge: float, out: np.ndarray) -> np.ndarray:
        """The mask of the pool's backends with room for `charge` (in `out`)."""
        fits = np.greater_equal(self._room, charge, out=out)
        if pool.mask is not None:
            fits &= pool.mask
        return fits

    def choose(self, pool: Pool, charge: float, hits: Hits | None, run_slack: float,
               min_hit: float = 0.0) -> tuple[BackendState | None, int]:
        """The backend for `charge` tokens and how much of the prefix it probably caches. A
        cached prefix shorter than `min_hit` tokens does not count toward the choice."""
        if self._arrays:
            return self._choose_arrays(pool, charge, hits, run_slack, min_hit)
        return self._choose_loops(pool.members, charge, hits.by_id if hits else None, run_slack,
                                  min_hit)

    def _choose_loops(self, backends: list[BackendState], charge: float,
                      matched: Mapping[str, int] | None, run_slack: float, min_hit: float
                      ) -> tuple[BackendState | None, int]:
        fits = []
        low = math.inf
        for b in backends:
            if b.limit - b.reserved >= charge:
                fits.append(b)
                util = b.reserved / b.view.capacity_tokens
                if util < low:
                    low = util
        if not fits:
            return None, 0
        kv_floor = low + self.locality_slack
        near = []
        least = math.inf
        for b in fits:
            if b.reserved / b.view.capacity_tokens <= kv_floor:
                near.append(b)
                if b.running < least:
                    least = b.running
        run_floor = least + run_slack
        best, best_rank, best_hit = None, None, 0
        for b in near:
            if b.running > run_floor:
                continue
            hit = matched.get(b.view.backend_id, 0) if matched else 0
            rank = (hit if hit >= min_hit else 0, b.limit - b.reserved)
            if best_rank is None or rank > best_rank:
                best, best_rank, best_hit = b, rank, hit
        return best, best_hit

    def _choose_arrays(self, pool: Pool, charge: float, hits: Hits | None,
                       run_slack: float, min_hit: float) -> tuple[BackendState | None, int]:
        # The same rule as the loops, in as few whole-array operations as it takes (each costs
        # half a microsecond to a microsecond at a few hundred backends, more than the
        # arithmetic). The masks: `fits` the pool's backends with room, `near` those within
        # the locality slack of the least KV use among them, `candidate` those of `near` within
        # the run slack of the fewest running among them. (Running counts are whole numbers:
        # within `least + run_slack` is at most its floor, `cut`.)
        room, util, running = self._room, self._util, self._running
        fits, near, candidate = self._fits, self._near, self._candidate
        last = self._last
        if last is not None and last.placed and last.pool is pool and last.charge == charge:
            # Only the chosen backend `t` moved since the last choice: each mask changes at
            # `t` alone unless a minimum it is relative to moved.
            t = last.index
            fits[t] = room[t] >= charge
            if last.low < last.util and last.low <= util[t]:
                low = last.low  # another backend holds the least KV use
            else:
                fitting = util[fits]
                if not fitting.size:
                    self._last = None
                    return None, 0
                low = _lowest(fitting)
            near_moved = low != last.low
            if near_moved:
                np.less_equal(util, low + self.locality_slack, out=near)
                near &= fits
            else:
                near[t] = fits[t] and util[t] <= low + self.locality_slack
            if not near_moved and last.least < last.running and last.least <= running[t]:
                least = last.least  # another backend of `near` runs the fewest
            else:
                least = _lowest(running[near])
            cut = math.floor(least + run_slack)
            if near_moved or cut != last.cut:
                np.less_equal(running, cut, out=candidate)
                candidate &= near
            else:
                candidate[t] = near[t] and running[t] <= cut
        else:
            self._fitting(pool, charge, fits)
            fitting = util[fits]
            if not fitting.size:
                self._last = None
                return None, 0
            low = _lowest(fitting)
            np.less_equal(util, low + self.locality_slack, out=near)
            near &= fits
            least = _lowest(running[near])
            cut = math.floor(least + run_slack)
            np.less_equal(running, cut, out=candidate)
            candidate &= near
        cached = hits.array if hits is not None else None
        best = candidate
        if cached is not None:
            # The longest match among the candidates (if it counts), then the most room, then
            # the first.
            best_hit = _highest(cached[candidate])
            if best_hit > 0 and best_hit >= min_hit:
                best = np.equal(cached, best_hit, out=self._best)
                best &= candidate
        i = int(np.where(best, room, -np.inf).argmax())
        if last is None:
            self._last = _Last(pool, charge, i, util[i], running[i], low, least, cut)
        else:  # (in place: a new record for each of a call's hundreds of choices costs more)
            last.pool, last.charge, last.index, last.placed = pool, charge, i, False
            last.util, last.running, last.low, last.least = util[i], running[i], low, least
            last.cut = cut
        return self.backends[i], int(cached[i]) if cached is not None else 0
