"""misa_t: admission with residency-time-aware KV accounting, workload KV shares and AIMD α.

Each `decide(snapshot)`:

1. Learn: completions feed the per-workload predictors (misa_t_predictors.py).
2. Account (residency): on each fresh heartbeat of a backend, re-charge its sessions. A
   single-turn session that has produced x tokens is charged prompt + the q-quantile of the
   lengths seen above x; a turn of a multi-turn session its context plus the same tail for the
   turn's output; a session parked on a tool keeps its history charged only while holding it
   is cheaper than re-prefilling it (expected remaining wait × history KV·s against the
   engine time a re-prefill costs, priced at the KV resident there), otherwise its charge is
   released. Changed charges go back in `Decision.recharge`.
3. Adapt α_b on that heartbeat (misa_t_control.AimdParams.step): back off on the engine's
   signals (a preemption, a growing queue, usage above the watermark), otherwise move toward
   the α at which the KV the engine reports in use would reach its target, given the measured
   ratio of used to charged KV on that backend (the loop between the ledger and the engine).
   Where the backend's residents are younger than the sessions that finished were over their
   residency (a cohort admitted together holds its prompts and is charged its expected ends),
   that ratio is scaled up by how much more they will hold: ∫KV dt / ∫charge dt of finished
   sessions against the residents' context per charged token now.
   Once every workload of the mixture has been seen and none is multi-turn, admission is open
   instead: α_b is `open_alpha` (the trainer's in-flight bound binds first) and the engine's
   own queue takes what does not fit, as behind a router. Without sessions parked between
   turns an overfull engine evicts nothing a later turn needs, and vLLM preempts the request
   it scheduled last, whose recompute mostly hits the prefix cache; held in the broker, a
   session waits for the next heartbeat while freed KV idles. A multi-turn workload closes
   admission for good, the loop's α taking over from where the reservations stand.
4. Allocate: workload w may hold σ_w of Σ_b α_b·C_b, σ_w ∝ π_w·K_w with a deficit correction;
   idle shares are lent, and lending stops (never preempts) once an owner has pending work.
   An owner below its share whose oldest session fits nowhere keeps the backend closest to
   fitting it for itself within the call (others place elsewhere), so the room freed there
   accumulates for it instead of being lent on to smaller sessions for good.
5. Admit, most under-served workload first, each workload oldest first: a GRPO group goes
   whole to one backend when it fits; otherwise each member (and any single session) goes to
   the backend with the longest cached-prefix match among those within `locality_slack` of
   the least-utilised, ties by headroom. A backend takes a session only while its reservations
   fit α_b·C_b. Follow-up turns (`turn > 0`) go home unconditionally.

Switches (`MisaTConfig`) turn off each mechanism; the ablations `misa_t-admission`,
`misa_t-allocation` and `misa_t-residency` are MISA-T with that one switch off. The variant
`misa_t-paced` adds mixture pacing to step 5: a workload that finishes sooner than the mixture's
mean session and whose share of the expected completion rate is above π_w admits nothing more
while others run (misa_t_control.CompletionPacer).
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from broker.policies import register, register_factory
from broker.policies.base import (
    Admission,
    BackendView,
    Completion,
    Decision,
    PendingItem,
    Policy,
    ResidentSession,
    Snapshot,
    Telemetry,
    default_reservation,
)
from broker.policies.misa_t_control import AimdParams, CompletionPacer, admissible, shares
from broker.policies.misa_t_predictors import PredictorParams, WorkloadModel
from broker.policies.misa_t_placement import BackendState, Hits, Placement, Pool
from broker.policies.misa_t_prefix import PrefixIndex, PrefixKey, prefix_key


_RUNNING = operator.attrgetter("running")
_LIMIT = operator.attrgetter("limit")
_TURN = operator.attrgetter("turn")


@dataclass(frozen=True, slots=True)
class MisaTConfig:
    adaptive_admission: bool = True  # off: α stays 1 (no AIMD)
    workload_allocation: bool = True  # off: no shares, no deficit; oldest first across workloads
    residency_accounting: bool = True  # off: charge prompt + max_tokens once, never re-charge
    prefix_placement: bool = True  # off: most headroom, no prefix index
    # Charge a session's expected end: "mean" = E[len | len > x] (what a sum over ~100
    # sessions per backend converges to); "quantile" = the length_quantile of that tail.
    tail_stat: str = "mean"
    length_quantile: float = 0.9  # used when tail_stat == "quantile"
    # Release a parked agentic session's charge when re-prefilling is cheaper than holding.
    # Off by default: a broker-placed session comes back to the *same* engine whatever the
    # ledger says, so a released charge is lent to new sessions that its next turn then
    # collides with (preemption). Only a router that re-places turns may release.
    release_parked: bool = False
    deficit_gain: float = 1.0  # σ_w scales by 1 + gain·relative consumed deficit, in [0.5, 2]
    # A workload below its share whose oldest session fits nowhere keeps the backend closest
    # to fitting it (most headroom) for itself within the call; off: pure work conservation.
    hold_for_blocked: bool = True
    # Mixture pacing (misa_t_control.CompletionPacer), off at inf: a workload in `pace_scope`
    # ("fast": finishing sooner than the mixture's mean session; "all") whose share of the
    # expected completion rate is above (1 + pace_tolerance)·π_w admits nothing more while
    # others run. It trades throughput for drift in fifo consumption (docs/misa-t.md §5,
    # revision 6); the `misa_t-paced` variant sets 0 and "fast".
    pace_tolerance: float = math.inf
    pace_scope: str = "fast"
    locality_slack: float = 0.15  # prefer a prefix match only within this KV utilisation of the least used ...
    # ... and within this many running sessions of the least loaded (at least
    # `balance_slack_sessions`, else `balance_slack_frac` of the mean): a decode batch piled on
    # one engine costs more than the prefills a prefix match saves.
    balance_slack_sessions: int = 1
    balance_slack_frac: float = 0.15
    recharge_tolerance: float = 0.05  # re-charge only when a charge moves by more than this fraction
    # Anticipate the growth of young residents (docs/misa-t.md §2, step 3): scale ρ_b by how much
    # more of their charge single-turn residents will hold, judged by finished sessions, once
    # that factor is beyond `growth_noise_band`/√n of 1 (n such residents: the spread of n
    # sessions' context-per-charge around its mean is about 1/√n of it).
    anticipate_growth: bool = True
    growth_noise_band: float = 2.0
    # Re-evaluate a session's charge once it has produced this many tokens more (~6 s of decode
    # at ~40 tok/s), its turn or parking changed, or recheck_s passed (a tool wait ageing).
    recheck_tokens: int = 256
    recheck_s: float = 5.0
    # Re-prefill price (the h200-30b-a3b profile's a and c, docs/engine-model.md): seconds of
    # engine step time per recomputed token and per (query, key) pair of that recompute.
    prefill_s_per_token: float = 11e-6
    prefill_s_per_pair: float = 1.8e-9
    # Open admission (docs/misa-t.md §2, step 3): once every workload of the mixture has been
    # seen and none is multi-turn, each backend admits up to `open_alpha`·C_b (the trainer's
    # in-flight bound binds first) and its engine queues what does not fit. Nothing is parked
    # between turns then, so the cache holds nothing that a preemption or an eviction would
    # cost a later turn, and vLLM preempts the request it scheduled last, whose recompute
    # mostly hits the prefix cache; holding sessions back in the broker only leaves freed KV
    # idle until the next heartbeat.
    open_single_turn: bool = True
    open_alpha: float = 100.0
    aimd: AimdParams = field(default_factory=AimdParams)
    predictors: PredictorParams = field(default_factory=PredictorParams)


@dataclass(slots=True)
class _Track:
    """What the policy remembers of one admitted session between heartbeats."""

    turn: int = -1  # last turn number seen in a heartbeat
    turn_base: int = 0  # generated_tokens when that turn was first seen (its progress origin)
    parked_since: float | None = None  # first heartbeat time seen waiting on a tool
    checked_tokens: int = -1  # generated_tokens when the charge was last computed
    checked_parked: bool = False  # waiting_on_tool then
    checked_at: float = 0.0  # heartbeat time then
    peak_context: int = 0  # largest context seen in a heartbeat (a multi-turn session's KV peak)
    # The ledger's charge in force since `charged_at`, and ∫ charge dt before that since the
    # admission; None for a session this policy object did not admit (a restarted broker's).
    charge: float = 0.0
    charged_at: float = 0.0
    charge_seconds: float | None = None

    def hold(self, now: float, charge: float) -> None:
        """The ledger charges `charge` from `now` on (what it charged before counts until now)."""
        if self.charge_seconds is not None:
            self.charge_seconds += self.charge * max(0.0, now - self.charged_at)
        self.charge, self.charged_at = charge, now


@dataclass(slots=True)
class _Booked:
    """One backend's accounting, kept across decide() calls and redone only where something
    moved (the broker's ViewCache and the simulator hand back the very same sessions tuple for
    an unchanged backend), so a call costs little per backend where nothing happened."""

    sessions: tuple[ResidentSession, ...] | None  # None after a re-charge: the next view differs
    capacity_tokens: int
    max_model_len: int
    by_workload: dict[str, float]  # charge per workload (whole tokens: sums stay exact)
    reserved: float
    in_flight: int
    growth: float  # the factor ρ_b is scaled by for its residents' age (1: none; `_growth`)
    # The backend's working state in a call, set from the sums above at the start of each call
    # (only where anything moved or the last call placed on it: `Placement.sync`).
    state: BackendState


@register
class MisaT(Policy):
    name = "misa_t"

    def __init__(self, config: MisaTConfig | None = None, **overrides: Any) -> None:
        self.config = replace(config or MisaTConfig(), **overrides)
        self.models: dict[str, WorkloadModel] = {}
        self.alpha: dict[str, float] = {}
        self.prefix = PrefixIndex()
        self._tracks: dict[str, _Track] = {}
        self._last_hb: dict[str, Telemetry] = {}
        self._calm_since: dict[str, float] = {}
        self._usage_ratio: dict[str, float | None] = {}  # ρ_b: KV in use per token charged
        self._booked: dict[str, _Booked] = {}  # per backend: its accounting at the last call
        self._used: dict[str, float] = {}  # Σ over the booked backends of their by_workload
        self._placement: Placement | None = None  # over the last call's healthy backends
        self._limit_total = 0.0  # within one decide(): Σ α_b·C_b over the healthy backends
        self._running = 0  # within one decide(): running sessions over the healthy backends
        self._healthy = 1  # ... and how many healthy backends there are
        self._max_len = 1 << 30  # smallest max_model_len seen: no context exceeds it
        self._keys: dict[str, PrefixKey] = {}  # prefix keys of pending items, by session (or group)
        self._now = 0.0  # within one decide(): the snapshot's time
        # The last call's views and each backend's state there, in fleet order, the healthy
        # ones' states, and the backends the next call must account again whatever their view
        # (`_account`).
        self._views: Sequence[BackendView] | None = None
        self._position: dict[str, int] = {}
        self._states: list[BackendState] = []
        self._out: list[BackendState] = []
        self._redo: set[str] = set()
        self._open = False  # admission open this call (`_opens`)
        self._multi_turn_seen = False  # a workload's model has max_turns > 1 (`_opens`)

    # -- predictions (misa_t-true-lengths overrides these two) ------------------------------------
    def admission_output(self, s: PendingItem | ResidentSession) -> float:
        """Output tokens to charge for the turn `s` starts next: a new placement's first (or
        current) turn, or a parked session's next one."""
        model = self._model(s.workload, s.max_tokens, s.max_turns)
        return min(s.max_tokens, self._turn_end(model, 0.0))

    def _turn_end(self, model: WorkloadModel, progress: float) -> float:
        if self.config.tail_stat == "quantile":
            return model.turn_output.tail_quantile(progress, self.config.length_quantile)
        return model.turn_output.expected_end(progress)

    def turn_output(self, session: ResidentSession, turn_index: int, progress: int) -> float:
        """Where the running turn is expected to end, given `progress` tokens so far."""
        model = self._model(session.workload, session.max_tokens, session.max_turns)
        end = self._turn_end(model, progress)
        return min(session.max_tokens, max(end, progress + 1))

    # -- decide --------------------------------------------------------------------------
    def decide(self, snapshot: Snapshot) -> Decision:
        decision = Decision()
        self._now = snapshot.now
        for c in snapshot.new_completions:
            self._learn(c)
        placement, used = self._account(snapshot, decision)
        if placement.backends:
            self._admit(snapshot, placement, used, decision)
        return decision

    def _model(self, workload: str, max_tokens: int, max_turns: int) -> WorkloadModel:
        model = self.models.get(workload)
        if model is None:
            model = WorkloadModel(max_tokens, max_turns, self.config.predictors)
            self.models[workload] = model
            self._multi_turn_seen |= max_turns > 1
        return model

    def _learn(self, c: Completion) -> None:
        model = self.models.get(c.workload)
        if model is None:
            return  # never admitted by this policy object: no caps known to seed a prior
        track = self._tracks.pop(c.session_id, None)
        model.observe(c, track.peak_context if track is not None else 0)
        if track is not None and track.charge_seconds is not None and model.max_turns <= 1:
            track.hold(c.finished_at, 0.0)
            if track.charge_seconds > 0:
                model.held_per_charged.add(c.kv_token_seconds, track.charge_seconds)

    # -- accounting and α ----------------------------------------------------------------
    def _account(self, snapshot: Snapshot, decision: Decision) -> tuple[Placement, dict[str, float]]:
        """Re-charge, adapt α; return the placement over the healthy backends (in fleet order)
        and the KV charged per workload.

        Only the backends that can have moved are visited: those whose view is not the very
        object of the last call, and those the last call left something to redo on (placed on,
        re-charged, an α the ledger does not show yet). Every other backend's accounting, α and
        state are what that call left, so a call costs little per backend where nothing
        happened, and a fleet of hundreds is not walked on every call."""
        views = snapshot.backends
        todo = self._moved_positions(views)
        self._redo.clear()
        next_charge = self._smallest_head_charge(snapshot.pending)  # (models for the heads)
        opened = self._opens(snapshot)
        if opened != self._open:
            self._open = opened
            todo = None  # every backend's limit changes
        moved: list[BackendState] = []  # states whose values changed since the last call
        if todo is None:  # the first call, or backends joined, left or were reordered
            states = self._states = [self._account_backend(view, next_charge, snapshot.now,
                                                            moved, decision) for view in views]
            self._position = {view.backend_id: i for i, view in enumerate(views)}
            if len(self._booked) > len(views):  # some backend left the fleet
                for b in [b for b in self._booked if b not in self._position]:
                    self._book(b, None)
                    self.prefix.drop_backend(b)
                    self._last_hb.pop(b, None)
                    self._usage_ratio.pop(b, None)
            out_changed = True
        else:
            states, last, out_changed = self._states, self._views, False
            for i in todo:
                view = views[i]
                state = self._account_backend(view, next_charge, snapshot.now, moved, decision)
                if state is not states[i] or view.healthy != last[i].healthy:
                    states[i] = state
                    out_changed = True
        if out_changed:
            self._out = [s for s, view in zip(states, views) if view.healthy]
        self._views = views
        out = self._out
        # (sums in fleet order, one by one: the same floats whichever backends were visited)
        self._running = functools.reduce(operator.add, map(_RUNNING, out), 0)
        self._limit_total = functools.reduce(operator.add, map(_LIMIT, out), 0.0)
        self._healthy = max(1, len(out))
        placement = self._placement
        # The same state objects in the same order (by identity: a backend that left and came
        # back has a new state, which may compare equal to its old one).
        if (placement is not None and len(placement.backends) == len(out)
                and all(map(operator.is_, placement.backends, out))):
            placement.sync(moved)
        else:
            placement = self._placement = Placement(out, self.config.locality_slack)
        return placement, dict(self._used)

    def _moved_positions(self, views: Sequence[BackendView]) -> list[int] | None:
        """The positions of `views` to account again (see `_account`), in fleet order; None
        when the fleet is not the last call's backends in the same order."""
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

    def _opens(self, snapshot: Snapshot) -> bool:
        """Whether admission is open this call: every workload of the mixture has been seen
        (a workload's kind is that of the first session seen of it: its `WorkloadModel`, the
        head of its queue, or on the first call a resident) and none runs more than one turn.
        A multi-turn workload closes it for good: its histories sit in the prefix cache between
        turns, where over-admission evicts them, and its returning turns are the requests vLLM
        preempts first. One not seen yet keeps it closed: its kind is unknown; so does a
        trainer that has set no mixture (the workloads to come are not known). Called after
        `_smallest_head_charge`, which has made the models of the queues' heads."""
        if not (self.config.open_single_turn and self.config.adaptive_admission):
            return False
        if self._views is None and not self._multi_turn_seen:  # a restarted broker's residents
            for v in snapshot.backends:
                for r in v.sessions:
                    self._model(r.workload, r.max_tokens, r.max_turns)
        if self._multi_turn_seen:
            return False
        declared = [w for w, pi in snapshot.mixture_target.items() if pi > 0]
        return bool(declared) and all(w in self.models for w in declared)

    def _smallest_head_charge(self, pending: Mapping[str, Sequence[PendingItem]]) -> float | None:
        """The smallest charge among the sessions next in line to start (each workload's oldest
        first turn; follow-up turns go home whatever α says); None when none waits."""
        smallest = None
        for items in pending.values():
            for item in items:
                if not item.turn:
                    charge = self._charge(item)
                    if smallest is None or charge < smallest:
                        smallest = charge
                    break
        return smallest

    def _account_backend(self, view: BackendView, next_charge: float | None, now: float,
                         moved: list[BackendState], decision: Decision) -> BackendState:
        """One backend's part of `_account`: its charges and α brought up to date, its state
        returned (appended to `moved` where its values changed)."""
        b = view.backend_id
        booked = self._booked.get(b)
        if booked is not None and booked.state.view is view and booked.sessions is view.sessions:
            # The very view of the last call (so no fresh heartbeat) with its sums kept.
            fresh = False
        else:
            hb = view.telemetry
            last = self._last_hb.get(b)
            fresh = hb is not None and (last is None or hb.at > last.at)
        if (not fresh and booked is not None and booked.sessions is view.sessions
                and booked.capacity_tokens == view.capacity_tokens
                and booked.max_model_len == view.max_model_len):
            # Nothing moved here since the last call: the same sums, α and prefix horizon (the
            # limit moves only when admission opens or closes).
            alpha = self._ledger_alpha(b)
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
            self._max_len = min(self._max_len, view.max_model_len)
            booked = self._charge_residents(view, now, fresh, decision)
            self._adapt_alpha(view, fresh, next_charge, booked.reserved, booked.growth, now)
            alpha = self._ledger_alpha(b)
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
        """Make `booked` the backend's accounting (None: forget it), keeping `_used` its sum."""
        used = self._used
        old = self._booked.pop(backend_id, None)
        if old is not None:
            for w, charge in old.by_workload.items():
                used[w] -= charge
        if booked is not None:
            self._booked[backend_id] = booked
            for w, charge in booked.by_workload.items():
                used[w] = used.get(w, 0.0) + charge

    def _charge_residents(self, view: BackendView, now: float, fresh: bool,
                          decision: Decision) -> _Booked:
        """Each resident session's charge (re-charged on a fresh heartbeat when residency
        accounting is on), summed per workload; returns (and keeps) the backend's booking."""
        recharge = fresh and self.config.residency_accounting
        booked = self._booked.get(view.backend_id)
        growth = booked.growth if booked is not None else 1.0
        if not recharge and booked is not None and booked.sessions is view.sessions:
            by_workload = booked.by_workload  # the very same sessions: their sums are known
        else:
            by_workload = {}
            # per workload: (context tokens, residents), for the growth factor of a fresh beat
            held: dict[str, list[float]] | None = (
                {} if recharge and self.config.anticipate_growth else None)
            for s in view.sessions:
                charge = self._recharge(s, view, now, decision) if recharge else s.reserved_tokens
                w = s.workload
                by_workload[w] = by_workload.get(w, 0.0) + charge
                if held is not None:
                    sums = held.setdefault(w, [0.0, 0])
                    sums[0] += s.context_tokens
                    sums[1] += 1
            if held is not None:
                growth = self._growth(by_workload, held)
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

    def _growth(self, charged: Mapping[str, float], held: Mapping[str, list[float]]) -> float:
        """The factor ρ_b is scaled by: how much more of what they are charged this backend's
        residents will hold, judged by the finished sessions of their workloads (`charged`:
        their charges per workload; `held`: their context tokens and their number).

        A finished single-turn session held `held_per_charged` (∫KV dt / ∫charge dt) over its
        residency; residents of every age, mixed as a steady state mixes them, hold that ratio
        of their charges now. Residents that hold less (a cohort admitted together: prompts
        in KV, expected ends charged) will grow into it. The factor is Σ_w ratio_w·charged_w
        over Σ_w context_w, where a workload with no learned ratio (too few finished sessions,
        or multi-turn sessions, whose context jumps by tool observations between heartbeats)
        counts its context on both sides; 1 where it does not pass the noise band, or is below
        1 (older residents: what the engine holds already says it)."""
        expected = total = 0.0
        n = 0  # residents of workloads with a learned ratio
        for w, (context, residents) in held.items():
            model = self.models.get(w)
            ratio = model.held_per_charged.ratio() if model is not None else None
            total += context
            if ratio is None:
                expected += context
            else:
                expected += ratio * charged[w]
                n += residents
        if n == 0 or total <= 0:
            return 1.0
        factor = expected / total
        return factor if factor >= 1.0 + self.config.growth_noise_band / math.sqrt(n) else 1.0

    def _adapt_alpha(self, view: BackendView, fresh: bool, next_charge: float | None,
                     reserved: float, growth: float, now: float) -> None:
        """Set the loop's α_b after this heartbeat (AIMD on the engine's own signals when it
        is fresh); the loop reads ρ_b scaled by `growth` (`_growth`)."""
        cfg = self.config
        b = view.backend_id
        # A restarted broker resumes from the ledger's α; without AIMD α is a constant.
        if not cfg.adaptive_admission:
            first = 1.0  # the ledger's own meaning: reservations may reach C_b
        else:
            # (capped: the ledger holds open_alpha while admission was open)
            first = min(view.alpha, cfg.aimd.alpha_max) if view.alpha > 0 else 1.0
        alpha = self.alpha.setdefault(b, first)
        calm_since = self._calm_since.setdefault(b, now)
        hb = view.telemetry
        if fresh:
            if cfg.adaptive_admission:
                before = self._last_hb.get(b)
                ratio = cfg.aimd.usage_ratio(self._usage_ratio.get(b), hb, reserved,
                                             view.capacity_tokens)
                self._usage_ratio[b] = ratio
                if ratio is not None:
                    ratio *= growth
                alpha = cfg.aimd.step(alpha, hb, before, next_charge=next_charge,
                                      reserved=reserved, capacity=view.capacity_tokens,
                                      ratio=ratio, calm_for=hb.at - calm_since)
                if cfg.aimd.backed_off(hb, before):
                    self._calm_since[b] = hb.at
            self._last_hb[b] = hb
        if self._open:
            # While admission is open the loop's α follows the reservations, so that it
            # closes where the ledger stands instead of far below it.
            alpha = min(cfg.aimd.alpha_max,
                        max(cfg.aimd.alpha_min, reserved / view.capacity_tokens, alpha))
        self.alpha[b] = alpha

    def _ledger_alpha(self, b: str) -> float:
        """The α the ledger holds for backend b: `open_alpha` while admission is open, else
        the loop's."""
        return self.config.open_alpha if self._open else self.alpha[b]

    def _recharge(
        self, s: ResidentSession, view: BackendView, now: float, decision: Decision
    ) -> float:
        cfg = self.config
        track = self._tracks.get(s.session_id)
        if track is None:  # admitted by a previous broker incarnation: start tracking now
            track = _Track()
            self._tracks[s.session_id] = track
        if s.context_tokens > track.peak_context:
            track.peak_context = s.context_tokens
        track.hold(now, float(s.reserved_tokens))  # what the ledger charges (it may refuse a growth)
        if (
            s.generated_tokens - track.checked_tokens < cfg.recheck_tokens
            and s.waiting_on_tool == track.checked_parked
            and s.turn == track.turn
            and now - track.checked_at < cfg.recheck_s
        ):
            return float(s.reserved_tokens)  # nothing moved enough to change the charge
        track.checked_tokens, track.checked_parked, track.checked_at = (
            s.generated_tokens, s.waiting_on_tool, now)
        charge = self.residency_charge(s, track, view, now)
        if abs(charge - s.reserved_tokens) > self.config.recharge_tolerance * max(
            s.reserved_tokens, 1
        ):
            decision.recharge[s.session_id] = int(charge)
            track.hold(now, float(int(charge)))
            return float(int(charge))
        return float(s.reserved_tokens)

    def residency_charge(
        self, s: ResidentSession, track: _Track, view: BackendView, now: float
    ) -> float:
        """The KV tokens session `s` should be charged now (docs/misa-t.md)."""
        if s.turn != track.turn:
            track.turn, track.turn_base = s.turn, s.generated_tokens
        if s.max_turns <= 1:
            end = self.turn_output(s, 0, s.generated_tokens)
            return s.prompt_tokens + end
        if s.waiting_on_tool:
            if track.parked_since is None:
                track.parked_since = now
            if self.config.release_parked and not self.hold_is_cheaper(
                s.workload, s.context_tokens, now - track.parked_since, view
            ):
                return 0.0
            charge = s.context_tokens + self.admission_output(s)
        else:
            track.parked_since = None
            progress = max(0, s.generated_tokens - track.turn_base)
            end = self.turn_output(s, max(0, s.turn - 1), progress)
            charge = s.context_tokens + max(0.0, end - progress)
        return max(charge, self.peak_estimate(s.workload, max(s.context_tokens, track.peak_context)))

    def peak_estimate(self, workload: str, context: float) -> float:
        """A multi-turn session's expected KV peak given the context it has reached:
        E[final context | final > context] once enough sessions have finished, else 0 (the
        per-turn charge alone then covers the running turn and is raised turn by turn)."""
        if self.config.tail_stat != "mean":
            return 0.0
        model = self.models.get(workload)
        if model is None or not model.final_context.warm:
            return 0.0
        return min(model.final_context.expected_end(context), float(self._max_len))

    def hold_is_cheaper(self, workload: str, history: int, waited: float, view: BackendView) -> bool:
        """Keep a parked session's history charged iff holding it for the expected rest of the
        tool wait costs fewer KV·token-seconds than re-prefilling it would.

        Holding: history × E[wait − waited | wait > waited]. Re-prefill: its engine time
        (a·H + c·H²/2 — chunked prefill stretches steps for the whole batch) times the KV
        resident on that backend, which sits idle-in-place for that long.
        """
        cfg = self.config
        model = self.models.get(workload)
        remaining = model.tool_wait.tail_mean(waited) if model else cfg.predictors.prior_tool_wait_s
        prefill_s = cfg.prefill_s_per_token * history + cfg.prefill_s_per_pair * history * history / 2
        usage = view.telemetry.kv_usage if view.telemetry is not None else 0.0
        resident = max(usage * view.capacity_tokens, history)
        return history * remaining <= prefill_s * resident

    # -- allocation and admission --------------------------------------------------------
    def _charge(self, item: PendingItem) -> float:
        self._model(item.workload, item.max_tokens, item.max_turns)  # seeded from its caps
        if not self.config.residency_accounting:
            return float(default_reservation(item))
        charge = item.prompt_tokens + self.admission_output(item)
        if item.max_turns > 1:
            charge = max(charge, self.peak_estimate(item.workload, item.prompt_tokens))
        return charge

    def _kv_seconds(
        self, fresh: Mapping[str, list[PendingItem]], target: Mapping[str, float]
    ) -> dict[str, float]:
        """K_w per workload. Without residency accounting, the static charge instead (KV
        tokens, not token-seconds): what an accounting blind to residency time would use."""
        out = {}
        for w in target:
            model = self.models.get(w)
            if model is None:
                if w not in fresh:
                    continue
                head = fresh[w][0]
                model = self._model(w, head.max_tokens, head.max_turns)
                model.note_prompt(head.prompt_tokens)
            if self.config.residency_accounting:
                out[w] = model.kv_seconds_per_session()
            else:
                out[w] = model.prompt_mean + model.max_tokens * model.max_turns
        return out

    def _admit(
        self,
        snapshot: Snapshot,
        placement: Placement,
        used: dict[str, float],
        decision: Decision,
    ) -> None:
        cfg = self.config
        fresh: dict[str, Sequence[PendingItem]] = {}
        by_id: dict[str, BackendState] | None = None
        for w, items in snapshot.pending.items():
            if any(map(_TURN, items)):
                # Follow-up turns (router mode) go home first, whatever the limits say: their
                # history is cached there.
                if by_id is None:
                    by_id = {b.view.backend_id: b for b in placement.backends}
                for item in items:
                    if item.turn and item.home_backend in by_id:
                        charge = self._charge(item)
                        home = by_id[item.home_backend]
                        self._place(item, home, charge, decision)
                        placement.placed(home)
                        used[w] = used.get(w, 0.0) + charge
                items = tuple(item for item in items if not item.turn)
            if items:
                fresh[w] = items
        if not fresh:
            return
        quota: dict[str, float] = {}
        if cfg.workload_allocation:
            total = self._limit_total
            sigma = shares(
                snapshot.mixture_target,
                self._kv_seconds(fresh, snapshot.mixture_target),
                snapshot.consumed,
                cfg.deficit_gain,
            )
            quota = {w: s * total for w, s in sigma.items()}
        pacer = self._pacer(snapshot, fresh) if cfg.workload_allocation else None
        cursor = dict.fromkeys(fresh, 0)
        live = set(fresh)
        held: dict[str, BackendState] = {}  # workload -> the backend kept for its blocked oldest
        pools: dict[str, Pool] = {}  # per workload: backends not held for another
        while live:
            if cfg.workload_allocation:
                # A workload whose oldest session fits nowhere right now does not hold the
                # others back (work conservation): only workloads still placing count.
                # (`live` holds exactly the workloads with sessions still to place.)
                allowed = admissible(live, used, quota)
                w = min(allowed, key=lambda v: (used.get(v, 0.0) / max(quota.get(v, 0.0), 1e-9), v))
                if pacer is not None and pacer.ahead(w):
                    live.discard(w)  # its completions would crowd the next batches
                    continue
            else:
                w = min(live, key=lambda v: (fresh[v][cursor[v]].enqueued_at, v))
            pool = pools.get(w)
            if pool is None:
                others = [b for v, b in held.items() if v != w]
                pool = pools[w] = placement.pool(others)
            taken, charged, need = self._admit_next(fresh[w], cursor[w], placement, pool,
                                                    decision)
            if not taken:
                live.discard(w)  # its oldest does not fit: FIFO within a workload, no overtaking
                if (cfg.workload_allocation and cfg.hold_for_blocked
                        and used.get(w, 0.0) < quota.get(w, 0.0)):
                    # Under-served and blocked: keep the backend closest to fitting it (most
                    # headroom) for it, so the room freed there accumulates instead of going
                    # to smaller sessions of other workloads, which would starve it for good
                    # (EASY backfilling's reservation for the queue head). Elsewhere lending
                    # goes on.
                    keep = placement.most_room(pool, need)
                    if keep is not None:
                        held[w] = keep
                        pools.clear()
                continue
            used[w] = used.get(w, 0.0) + charged
            cursor[w] += taken
            if pacer is not None:
                pacer.admitted(w, taken)
            if cursor[w] >= len(fresh[w]):
                live.discard(w)

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
        duration: dict[str, float] = {}
        for w in snapshot.mixture_target.keys() | fresh.keys():
            model = self.models.get(w)
            if model is None and w in fresh:
                head = fresh[w][0]
                model = self._model(w, head.max_tokens, head.max_turns)
            if model is not None:
                duration[w] = max(model.duration_s(), 1e-3)
        return CompletionPacer.start(snapshot.mixture_target, self.config.pace_tolerance,
                                     duration, in_flight, self.config.pace_scope)

    def _admit_next(
        self,
        items: Sequence[PendingItem],
        start: int,
        placement: Placement,
        pool: Pool,
        decision: Decision,
    ) -> tuple[int, float, float]:
        """Admit the item at `start` (with the rest of its GRPO group): (how many, KV charged,
        the charge of the item at `start`)."""
        head = items[start]
        need = self._charge(head)
        if not placement.fits(pool, need):
            return 0, 0.0, need  # (the usual end of a workload's turn in a call: no lookups)
        group = [head]
        if head.group_id is not None and head.group_size > 1:
            for it in items[start + 1 : start + head.group_size]:
                if it.group_id != head.group_id or it.turn > 0:
                    break
                group.append(it)
        key = self._key(head) if self.config.prefix_placement else None
        hits = (placement.hits(self.prefix.matches(key))
                if key is not None and key.hashes else None)
        # Member by member: the first placement puts the group's prefix in the index, so the
        # rest follow it to that backend while its decode batch stays within the balance
        # slack, and spill to the next one (one more prefill of the shared prompt) beyond it.
        taken, charged = 0, 0.0
        fed: dict[str, float] = {}  # per backend: KV tokens the group's placements allocate there
        for it in group:
            ch = need if it is head else self._charge(it)
            target, hit = self._choose(placement, pool, ch, hits)
            if target is None:
                break
            self._place(it, target, ch, decision)
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
        return taken, charged, need

    def _key(self, item: PendingItem) -> PrefixKey:
        cache_id = item.group_id if item.group_id is not None else item.session_id
        key = self._keys.get(cache_id)
        if key is None:
            key = prefix_key(item.prefix)
            if len(self._keys) > 65536:
                self._keys.clear()
            self._keys[cache_id] = key
        return key

    def _choose(
        self, placement: Placement, pool: Pool, charge: float, hits: Hits | None
    ) -> tuple[BackendState | None, int]:
        """The backend for `charge` tokens, and how much of the key of `hits` it probably
        caches: balance first (KV use, then running sessions), then the longest cached prefix,
        then headroom (misa_t_placement.py)."""
        cfg = self.config
        run_slack = max(cfg.balance_slack_sessions,
                        cfg.balance_slack_frac * self._running / self._healthy)
        return placement.choose(pool, charge, hits, run_slack)

    def _place(
        self,
        item: PendingItem,
        target: BackendState,
        charge: float,
        decision: Decision,
    ) -> None:
        """Admit `item` to `target` (`_admit_next` records in the prefix index where it placed
        each group)."""
        b = target.view.backend_id
        target.reserved += charge
        target.running += 1
        self._running += 1
        self._redo.add(b)
        decision.admissions.append(Admission(item.session_id, b, int(charge)))
        if item.turn == 0:  # each session's prompt counts once, when it is placed
            self.models[item.workload].note_prompt(item.prompt_tokens)
        self._tracks[item.session_id] = _Track(charge=float(int(charge)), charged_at=self._now,
                                               charge_seconds=0.0)


def _variant(name: str, **settings: Any) -> Callable[..., MisaT]:
    def make(**params: Any) -> MisaT:
        policy = MisaT(**{**settings, **params})
        policy.name = name
        return policy

    return make


register_factory("misa_t-admission", _variant("misa_t-admission", adaptive_admission=False))
register_factory("misa_t-allocation", _variant("misa_t-allocation", workload_allocation=False))
register_factory("misa_t-residency", _variant("misa_t-residency", residency_accounting=False))
# Not an ablation: MISA-T with mixture pacing, for fifo trainers that keep enough sessions in
# flight to fill the KV cache; where the trainer's buffer is the limit it costs throughput
# (docs/misa-t.md §5, revision 6).
register_factory("misa_t-paced", _variant("misa_t-paced", pace_tolerance=0.0))
