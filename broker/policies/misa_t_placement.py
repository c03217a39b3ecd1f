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
where a few backends changed does not rebuild them over the fleet.
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


ARRAY_MIN_BACKENDS = 128  # measured 2026-11-30: a choice cost ~30 µs in arrays at any size, the
# loops ~0.25 µs per backend (equal at 128, loops 6 µs at 16, arrays 2× faster at 256); the
# array path has got cheaper since, and the threshold was not measured again


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
            self._running = np.array([b.running for b in self.backends], dtype=np.int64)
            n = len(self.backends)  # scratch masks, reused by every choice of the call
            self._fits, self._near, self._candidate = (np.empty(n, dtype=bool) for _ in range(3))

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
            return _any(self._fitting(pool, charge))
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
        big = np.greater_equal(self._limit, charge, out=self._fits)
        if pool.mask is not None:
            big &= pool.mask
        if not _any(big):
            return None
        return self.backends[int(np.where(big, self._room, -np.inf).argmax())]

    def _fitting(self, pool: Pool, charge: float) -> np.ndarray:
        """The mask of the pool's backends with room for `charge` (in the scratch `_fits`)."""
        fits = np.greater_equal(self._room, charge, out=self._fits)
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
        # one to three microseconds at a few hundred backends, more than the arithmetic).
        room, util, running = self._room, self._util, self._running
        fits = self._fitting(pool, charge)
        fitting = util[fits]
        if not fitting.size:
            return None, 0
        low = _lowest(fitting)
        near = np.less_equal(util, low + self.locality_slack, out=self._near)
        near &= fits
        least = _lowest(running[near])
        candidate = np.less_equal(running, least + run_slack, out=self._candidate)
        candidate &= near
        if hits is None or hits.array is None:
            return self.backends[int(np.where(candidate, room, -np.inf).argmax())], 0
        # The longest match among the candidates (if it counts), then the most room, then the
        # first.
        best_hit = _highest(hits.array[candidate])
        if best_hit > 0 and best_hit >= min_hit:
            candidate &= hits.array == best_hit
        i = int(np.where(candidate, room, -np.inf).argmax())
        return self.backends[i], int(hits.array[i])
