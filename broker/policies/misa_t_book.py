"""MISA-T's per-backend book: steps 2 and 3 of `misa_t.py` over the fleet, done incrementally.

`Book.account` brings every backend's charges (`Residency.recharge`) and α (`AlphaLoop.adapt`)
up to date and hands the admission step an `Accounted`: the healthy backends' working states
in a `Placement`, the KV charged per workload and the fleet's totals.

The incremental part: the broker's ViewCache and the simulator hand back the very same view
object (and sessions tuple) for a backend where nothing changed, so only backends whose view is
not the last call's object, and those the last call left something to redo on (placed on,
re-charged, an α the ledger does not show yet), are visited. Every other backend's sums, α and
state are what that call left, so a call costs little per backend where nothing happened and a
fleet of hundreds is not walked on every call. tests/broker/policies/test_misa_t.py checks,
step by step on random fleets, that this gives what accounting every backend afresh gives.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from broker.policies.base import Admission, BackendView, Decision, Snapshot
from broker.policies.misa_t_alpha import AlphaLoop
from broker.policies.misa_t_charges import Residency
from broker.policies.misa_t_placement import BackendState, Placement
from broker.policies.misa_t_prefix import PrefixIndex

if TYPE_CHECKING:
    from broker.policies.misa_t import Call, MisaTConfig

_RUNNING = operator.attrgetter("running")
_LIMIT = operator.attrgetter("limit")


@dataclass(slots=True)
class _Booked:
    """One backend's accounting, kept across decide() calls and redone only where something
    moved."""

    sessions: tuple | None  # the view's sessions; None after a re-charge: the next view differs
    capacity_tokens: int
    max_model_len: int
    by_workload: dict[str, float]  # charge per workload (whole tokens: sums stay exact)
    reserved: float
    in_flight: int
    growth: float  # the factor ρ_b is scaled by for its residents' age (`Residency.growth`)
    # The backend's working state in a call, set from the sums above at the start of each call
    # (only where anything moved or the last call placed on it: `Placement.sync`).
    state: BackendState


@dataclass(frozen=True, slots=True)
class Accounted:
    """What the admission step starts from."""

    placement: Placement  # the healthy backends' states, in fleet order
    used: dict[str, float]  # KV charged per workload (the caller's copy: admissions add to it)
    limit_total: float  # Σ α_b·C_b over the healthy backends
    running: int  # running sessions over the healthy backends
    healthy: int  # how many healthy backends (at least 1)


class Book:
    def __init__(self, config: MisaTConfig, residency: Residency, alpha_loop: AlphaLoop,
                 prefix: PrefixIndex) -> None:
        self.config = config
        self.residency = residency
        self.alpha_loop = alpha_loop
        self.prefix = prefix
        self.booked: dict[str, _Booked] = {}  # per backend: its accounting at the last call
        self.used: dict[str, float] = {}  # Σ over the booked backends of their by_workload
        # The last call's views and each backend's state there, in fleet order, the healthy
        # ones' states, and the backends the next call must account again whatever their view.
        self._views: Sequence[BackendView] | None = None
        self._position: dict[str, int] = {}
        self._states: list[BackendState] = []
        self._out: list[BackendState] = []
        self._redo: set[str] = set()
        self._placement: Placement | None = None  # over the last call's healthy backends

    @property
    def first_call(self) -> bool:
        return self._views is None

    def account(self, snapshot: Snapshot, call: Call, decision: Decision) -> Accounted:
        """Re-charge and adapt α where anything can have moved (every backend when the fleet
        changed or admission opened or closed); α changes and re-charges go in `decision`."""
        views = snapshot.backends
        todo = None if call.open_changed else self._moved_positions(views)
        self._redo.clear()
        moved: list[BackendState] = []  # states whose values changed since the last call
        if todo is None:  # the first call, or backends joined, left or were reordered
            self._account_all(views, call, moved, decision)
        else:
            self._account_moved(views, todo, call, moved, decision)
        self._views = views
        out = self._out
        # (sums in fleet order, one by one: the same floats whichever backends were visited)
        running = functools.reduce(operator.add, map(_RUNNING, out), 0)
        limit_total = functools.reduce(operator.add, map(_LIMIT, out), 0.0)
        return Accounted(self._placement_over(out, moved), dict(self.used), limit_total,
                         running, max(1, len(out)))

    def placed(self, admissions: Sequence[Admission]) -> None:
        """The admission step placed these: account their backends again next call."""
        self._redo.update(adm.backend_id for adm in admissions)

    def _account_all(self, views: Sequence[BackendView], call: Call,
                     moved: list[BackendState], decision: Decision) -> None:
        self._states = [self._account_backend(view, call, moved, decision) for view in views]
        self._position = {view.backend_id: i for i, view in enumerate(views)}
        if len(self.booked) > len(views):  # some backend left the fleet
            for b in [b for b in self.booked if b not in self._position]:
                self._book(b, None)
                self.prefix.drop_backend(b)
                self.alpha_loop.forget(b)
        self._out = [s for s, view in zip(self._states, views) if view.healthy]

    def _account_moved(self, views: Sequence[BackendView], todo: list[int], call: Call,
                       moved: list[BackendState], decision: Decision) -> None:
        states, last, out_changed = self._states, self._views, False
        for i in todo:
            view = views[i]
            state = self._account_backend(view, call, moved, decision)
            if state is not states[i] or view.healthy != last[i].healthy:
                states[i] = state
                out_changed = True
        if out_changed:
            self._out = [s for s, view in zip(states, views) if view.healthy]

    def _placement_over(self, out: list[BackendState], moved: list[BackendState]) -> Placement:
        """The last call's placement synced where states moved, while it holds the same state
        objects in the same order (by identity: a backend that left and came back has a new
        state, which may compare equal to its old one); else a new one."""
        placement = self._placement
        if (placement is not None and len(placement.backends) == len(out)
                and all(map(operator.is_, placement.backends, out))):
            placement.sync(moved)
        else:
            placement = self._placement = Placement(out, self.config.locality_slack)
        return placement

    def _moved_positions(self, views: Sequence[BackendView]) -> list[int] | None:
        """The positions of `views` to account again, in fleet order; None when the fleet is
        not the last call's backends in the same order."""
        last = self._views
        if last is None or len(last) != len(views):
            return None
        todo = {self._position[b] for b in self._redo}
        if views is not last:
            for i in itertools.compress(range(len(views)), map(operator.is_not, views, last)):
                if views[i].backend_id != last[i].backend_id:
                    return None
                todo.add(i)
        return sorted(todo)

    def _account_backend(self, view: BackendView, call: Call, moved: list[BackendState],
                         decision: Decision) -> BackendState:
        """One backend's charges and α brought up to date, its state returned (appended to
        `moved` where its values changed)."""
        b = view.backend_id
        booked = self.booked.get(b)
        # The very view of the last call (so no fresh heartbeat) with its sums kept?
        fresh = not (booked is not None and booked.state.view is view
                     and booked.sessions is view.sessions) and self.alpha_loop.is_fresh(view)
        if (not fresh and booked is not None and booked.sessions is view.sessions
                and booked.capacity_tokens == view.capacity_tokens
                and booked.max_model_len == view.max_model_len):
            # Nothing moved here since the last call: the same sums, α and prefix horizon (the
            # limit moves only when admission opens or closes).
            alpha = self.alpha_loop.ledger_alpha(view)
            state = booked.state
            state.view = view
            limit = alpha * view.capacity_tokens
            if (state.reserved != booked.reserved or state.running != booked.in_flight
                    or state.limit != limit):
                state.reserved, state.running = booked.reserved, booked.in_flight  # placed on
                state.limit = limit
                moved.append(state)
        else:
            self.prefix.sync_backend(b, view.capacity_tokens)
            predict = self.residency.predictions
            predict.max_len = min(predict.max_len, view.max_model_len)
            booked = self._charge_residents(view, call.now, fresh, decision)
            self.alpha_loop.adapt(view, fresh, call.next_charge, booked.reserved, booked.growth,
                                  call.now)
            alpha = self.alpha_loop.ledger_alpha(view)
            state = booked.state
            state.limit = alpha * view.capacity_tokens
            moved.append(state)
        if abs(view.alpha - alpha) > 1e-9:
            decision.alpha[b] = alpha
            self._redo.add(b)  # said again while the ledger's α differs
        if booked.sessions is None:
            self._redo.add(b)  # re-charged: the sums are redone from the next view
        return state

    def _book(self, backend_id: str, booked: _Booked | None) -> None:
        """Make `booked` the backend's accounting (None: forget it), keeping `used` its sum."""
        used = self.used
        old = self.booked.pop(backend_id, None)
        if old is not None:
            for w, charge in old.by_workload.items():
                used[w] -= charge
        if booked is not None:
            self.booked[backend_id] = booked
            for w, charge in booked.by_workload.items():
                used[w] = used.get(w, 0.0) + charge

    def _charge_residents(self, view: BackendView, now: float, fresh: bool,
                          decision: Decision) -> _Booked:
        """Each resident session's charge (re-charged on a fresh heartbeat when residency
        accounting is on), summed per workload; returns (and keeps) the backend's booking."""
        recharge = fresh and self.config.residency_accounting
        booked = self.booked.get(view.backend_id)
        growth = booked.growth if booked is not None else 1.0
        if not recharge and booked is not None and booked.sessions is view.sessions:
            by_workload = booked.by_workload  # the very same sessions: their sums are known
        else:
            by_workload, growth = self._sum_charges(view, now, recharge, decision, growth)
        reserved = 0.0
        for charge in by_workload.values():
            reserved += charge
        state = BackendState(view, 0.0, reserved, view.in_flight) if booked is None else booked.state
        state.view, state.reserved, state.running = view, reserved, view.in_flight
        # After a re-charge the next view carries the new charges: nothing to reuse then.
        booked = _Booked(None if recharge else view.sessions, view.capacity_tokens,
                         view.max_model_len, by_workload, reserved, view.in_flight, growth, state)
        self._book(view.backend_id, booked)
        return booked

    def _sum_charges(self, view: BackendView, now: float, recharge: bool, decision: Decision,
                     growth: float) -> tuple[dict[str, float], float]:
        """Charges per workload over the view's residents (re-charged if `recharge`), and the
        growth factor (new on a re-charge with `anticipate_growth`, else `growth`)."""
        by_workload: dict[str, float] = {}
        # per workload: residents, for the growth factor of a fresh beat
        residents: dict[str, int] | None = (
            {} if recharge and self.config.anticipate_growth else None)
        for s in view.sessions:
            charge = (self.residency.recharge(s, view, now, decision) if recharge
                      else s.reserved_tokens)
            w = s.workload
            by_workload[w] = by_workload.get(w, 0.0) + charge
            if residents is not None:
                residents[w] = residents.get(w, 0) + 1
        if residents is not None and view.telemetry is not None:
            growth = self.residency.growth(by_workload, residents,
                                           view.telemetry.kv_usage * view.capacity_tokens)
        return by_workload, growth
