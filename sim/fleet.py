"""The fleet simulator: N simulated vLLM engines, a policy, agentic tool waits and the trainer,
on one virtual clock (one policy core, two drivers: docs/measurement.md).

What the policy sees is what the live broker would see: pending placements, the ledger
(its own admissions and reservations, immediately), and per-backend telemetry and per-session
progress from a heartbeat every `telemetry.heartbeat_s` virtual seconds that arrives
`telemetry.lag_s` after the numbers were taken (the scenario's `telemetry`). The simulated
truth (output lengths, tool latencies) drives the engines and tools and never enters a
snapshot.

Dispatch: a policy with `dispatch_on_arrival` (an HTTP router) places every request — each
agentic turn too — as it arrives, and the engine queues it. A broker policy places whole
sessions when it chooses to; the session's later turns run on the same backend.

Agent-driven workloads (`driver: agent`): the user's agent calls the gateway once per turn and
works for the truth's `tool_latency_s` between calls. No worker runs such an episode, so no
heartbeat reports its progress: the policy sees it as the live broker's snapshot does
(broker/snapshot.py without worker progress), as admitted — context its admitted prompt,
nothing generated, turn 0, never `waiting_on_tool`, `max_turns` the calls it had left. A gap
longer than `idle_timeout_s` parks the episode (its ledger charge is released when the timeout
expires) and its next call goes back to the front of its workload's queue, with the whole
history as its prompt and its original enqueue time, to be admitted again on any backend, as
broker/episodes.py queues it. Routers release every turn anyway: for them the driver changes
nothing.

Engines joining and leaving (`fleet.changes`, sim.membership): an added engine gets a fresh
backend id, registers a ledger entry that refuses admissions, and is in the snapshot from its
first heartbeat delivered. A removed engine drains as the live worker does on SIGTERM: it leaves
the snapshot and takes no admission, its sessions run on for the drain grace, then each one still
there goes back to the queue with what it had generated (a cut turn's partial output kept, as a
`Session.resume_from` is), to go on elsewhere without generating anything twice. The run reports
what that cost (`ScaleStats`), measured from the tokens the engines generated.

The event loop takes, at each iteration, the earliest of: an engine's next segment end
(`EngineCore.next_event_time`), a tool return, a reward/test completion, a heartbeat, a fleet
change or the end of a leaving engine's drain grace. The
policy is asked after every batch of events at one instant that changed what it could decide.

The loop's own cost per event does not grow with the fleet: the engines' next event times are
kept in a heap (each engine reports, through `EngineCore.on_change`, every call that may move
its time; stale heap entries are dropped when they surface), the snapshot reuses each backend's
`BackendView` until its resident sessions, telemetry or α change, and the pending ids, the
engines with unfinished requests and the ledger entries a decision touches are kept or found
without a scan. `check=True` compares each of these with a full scan, on every event and every
decide (the tests run it: tests/sim/test_fleet_index.py).
"""

from __future__ import annotations

import copy
import heapq
import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from broker.decision import LedgerEntry, apply_decision, touched_backends
from broker.gc_tuning import few_collections
from broker.policies.base import (
    BackendView,
    Completion,
    Decision,
    PendingItem,
    Policy,
    ResidentSession,
    Snapshot,
    Telemetry,
    kv_token_seconds,
)
from sim.engine.core import EngineCore
from sim.engine.profiles import get_profile
from sim.engine.request import EngineRequest, FinishReason
from sim.metrics import (
    EngineCounters,
    IterationRecord,
    KvSample,
    LoraStats,
    RunMetrics,
    ScaleStats,
    SessionRecord,
    Trainer,
    WeightUpdateStats,
    summarize,
)
from sim.engine.adapter_slots import AdapterSlots
from sim.membership import Membership
from sim.scenario import Scenario
from sim.workloads.source import SessionSource
from sim.workloads.truth import SimSession

# Event kinds, in the order they are handled at one instant.
_RESULT, _TOOL_RETURN, _HEARTBEAT, _TELEMETRY, _ARRIVAL, _TRAINED, _RESUME = 0, 1, 2, 3, 4, 5, 6
_PARK = 7  # an agent-driven episode's idle timeout
_FLEET, _CUT = 8, 9  # a scheduled fleet change (fleet.changes); a leaving engine's grace ends
_LORA = 10  # a LoRA adapter has loaded on an engine: the turn waiting for it starts


class SimulationError(RuntimeError):
    """The run cannot go on (a policy that never admits, a limit reached)."""


@dataclass(slots=True)
class _Live:
    """A session in flight: its truth, where it runs, and what it has produced so far."""

    sim: SimSession
    enqueued_at: float
    admitted_at: float | None = None
    backend: str | None = None  # home backend (broker policies) or the current turn's (routers)
    reserved: int = 0  # ledger charge
    turn: int = 0  # the turn now running or next to run
    outputs: list[list[int]] = field(default_factory=list)  # per finished turn
    generated: int = 0  # output tokens of the finished turns
    history: list[int] = field(default_factory=list)  # the next turn's prompt
    history_hashes: list[int] = field(default_factory=list)  # its leading full blocks' chain hashes
    cached_tokens: int = 0
    first_token_at: float | None = None
    request: EngineRequest | None = None  # the turn on an engine now
    prompt_len: int = 0  # this turn's prompt length
    parked_context: int = 0  # tokens of history in KV after the last finished turn
    waiting_on_tool: bool = False  # between turns (agent-driven: between calls)
    # Released until its next turn, which is queued to be admitted again (anywhere): an
    # agent-driven episode idle past the timeout, or a session whose engine left between turns.
    parked: bool = False
    # Its latest admission: prompt tokens, calls it had left, when (an agent-driven view).
    placed_prompt: int = 0
    placed_turns: int = 0
    placed_at: float = 0.0
    tool_wait_s: float = 0.0
    kv_turns: list[tuple[int, int, float]] = field(default_factory=list)  # see kv_token_seconds
    kv_waits: list[tuple[int, float]] = field(default_factory=list)
    truncated: bool = False
    partial: list[int] = field(default_factory=list)  # this turn's output before a pause stopped it
    resuming: bool = False  # the request on the engine resumes a stopped turn
    partial_from_scale_in: bool = False  # `partial` is from a leaving engine (else a pause)
    # Output tokens the engines generated for it, every request counted (stopped ones too), and
    # of those the ones a pause threw away (partial: false): the rest are in its result.
    engine_tokens: int = 0
    thrown_away: int = 0
    handed_back: int = 0  # times a leaving engine handed it back to the queue
    # LoRA: its turn waits for an adapter slot on its engine, or for the adapter to load
    # (while either, it has no request on the engine but holds its place there).
    slot_wait_since: float | None = None  # when it began waiting for a slot; None: not waiting
    loading: bool = False
    slot_held: bool = False  # its turn holds one of the engine's adapter slots


@dataclass(slots=True)
class _Pause:
    """A weight update in progress: pause → every engine paused → `sync_s` → resume."""

    started_at: float
    paused_at: float | None = None  # None while engines drain (abort, wait)


@dataclass
class FleetResult:
    policy: str
    metrics: RunMetrics
    iterations: list[IterationRecord]
    sessions: list[SessionRecord]
    kv_samples: list[KvSample]
    engines: list[EngineCounters]
    completed: bool  # every trainer iteration finished before a limit cut the run
    sim_time_s: float
    decide_calls: int
    parked: int = 0  # agent-driven episodes released after idle_timeout_s between calls
    # Every completion handed to the policy, in order: what a later run of the same job
    # recalls (`Policy.recall`, bench --warm-start).
    completions: tuple[Completion, ...] = ()


class FleetSim:
    def __init__(self, scenario: Scenario, policy: Policy | None, source: SessionSource, *,
                 on_iteration: Callable[[IterationRecord], None] | None = None,
                 check: bool = False) -> None:
        """`check=True` compares the next-event heap with a scan of every engine on every
        event, the cached backend views with fresh ones, the pending-id set with the queues and
        the decision applied to the ledger entries it touches with it applied to a copy of the
        whole ledger on every decide, and the engines with unfinished requests with a scan
        during a pause; it raises SimulationError("check: ...") at the first difference (slow;
        for tests)."""
        self.scenario = scenario
        self.check = check
        self.policy = policy
        self.heartbeat_s = scenario.telemetry.heartbeat_s
        self.lag_s = scenario.telemetry.lag_s
        # (a beat reports the tokens of a turn in flight: a streaming worker's view)
        self.streamed = scenario.telemetry.progress == "decoding"
        self.on_iteration = on_iteration
        try:
            profile = get_profile(scenario.fleet.profile).with_limits(
                scenario.fleet.max_num_seqs, scenario.fleet.max_num_batched_tokens)
        except ValueError as e:
            raise SimulationError(f"fleet.{e}") from None
        if scenario.vocab_size > profile.vocab_size:
            raise SimulationError(
                f"vocab_size: {scenario.vocab_size} exceeds the {profile.name} profile's "
                f"vocabulary ({profile.vocab_size}); prompts would hold ids the model lacks")
        self._profile = profile
        self.engines: dict[str, EngineCore] = {}  # made below (`_new_engine`)
        self._scale_totals = {"engines_joined": 0, "engines_left": 0, "sessions_handed_back": 0,
                              "tokens_handed_back": 0, "tokens_lost_to_scale_in": 0,
                              "reprefill_tokens": 0}
        self.trainer = Trainer.from_scenario(scenario, source)
        self.now = 0.0
        self.live: dict[str, _Live] = {}
        self.by_request: dict[str, _Live] = {}
        self.pending: dict[str, deque[PendingItem]] = {w: deque() for w in scenario.mixture}
        self._pending_ids: set[str] = set()  # the session ids in `pending`
        # The ledger as the live broker keeps it: resident sessions per backend as the policy
        # sees them (reservations at once, progress as the last delivered heartbeat said),
        # α per backend; and each resident session's progress as it truly is now.
        self.resident: dict[str, dict[str, ResidentSession]] = {}
        self._progress: dict[str, dict[str, ResidentSession]] = {}
        self._beats: deque[tuple[dict[str, Telemetry], dict[str, dict[str, ResidentSession]]]] = deque()
        self.ledger: dict[str, LedgerEntry] = {}
        self.telemetry: dict[str, Telemetry] = {}
        self.completions: list[Completion] = []  # finished since the last decide()
        self.learned: list[Completion] = []  # every completion handed to the policy
        self.records: list[SessionRecord] = []
        self.enqueued: list[tuple[SimSession, float]] = []  # every session, with when (for traces)
        self.kv_samples: list[KvSample] = []
        self._events: list[tuple[float, int, int, str]] = []
        self._seq = itertools.count()
        self._dirty = True  # something changed that the policy may act on
        self._arrival_at: float | None = None  # when the scheduled trace-arrival event fires
        self.decide_calls = 0
        self.weight_update = scenario.trainer.weight_update
        # Agent-driven workloads and their idle timeouts (sim.scenario.AgenticSpec.driver).
        self.idle_timeout_s: dict[str, float] = {
            w: t for w, spec in scenario.workloads.items()
            if (t := getattr(spec, "parking_timeout_s", None)) is not None}
        self.parked = 0  # episodes parked so far
        self._agent_view: set[str] = set()  # agent-driven workloads under a broker policy (_run)
        self._pause: _Pause | None = None
        # The trainer (weight updates only): batches it has not trained on yet, batches
        # trained, and whether it is busy (training, or pushing weights to the engines).
        self._untrained = 0
        self._trained = 0
        self._trainer_busy = False
        self._held: list[_Live] = []  # turns submitted while paused: they start on resume
        self._update_totals = {"updates": 0, "paused_s": 0.0, "drain_s": 0.0, "tokens_kept": 0,
                               "tokens_thrown_away": 0, "reprefill_tokens": 0}
        # The engines' next event times: the time each engine reports now (None: nothing to
        # do), and a heap of (time, engine id) with an entry for each; entries whose time is
        # no longer the engine's are stale and dropped when they reach the top. Ties go to the
        # smaller engine id, as a scan with min() over (time, id) gives.
        self._next_at: dict[str, float | None] = {}
        self._engine_heap: list[tuple[float, str]] = []
        self._unfinished: set[str] = set()  # engines with unfinished requests (has_unfinished)
        # LoRA (fleet.max_loras > 0): per engine, its adapter slots (the rule the simulated
        # engine's server applies, sim/engine/adapter_slots.py) and the adapters it has loaded,
        # least recently used first, as many as its slots (the worker's default --lora-cache).
        self._slots: dict[str, AdapterSlots[_Live]] = {}
        self._loaded: dict[str, OrderedDict[str, None]] = {}
        self._lora_totals = {"loads": 0, "slot_waits": 0, "slot_wait_s": 0.0}
        self._loading: dict[str, list[_Live]] = {}  # "engine|adapter" -> turns waiting for it
        for _ in range(scenario.fleet.engines):
            self._new_engine()
        # Engines joining and leaving (fleet.changes): their states, and what the changes did.
        self.members = Membership(self.engines)
        # The backend views of the last snapshot (the visible engines, in engine order), and
        # the backends whose view must be built again: their resident sessions, telemetry or α
        # changed (marks of engines not in the snapshot are skipped).
        self._view_pos = {b: i for i, b in enumerate(self.members.visible)}
        self._views: list[BackendView | None] = [None] * len(self._view_pos)
        self._views_tuple: tuple[BackendView, ...] | None = None
        self._stale_views: set[str] = set(self.engines)

    def true_output_lengths(self, session_id: str) -> tuple[int, ...]:
        """The hidden truth, for the `misa_t-true-lengths` reference only (the bench wires it in)."""
        return self.live[session_id].sim.truth.output_tokens

    # -- driving ---------------------------------------------------------------------------
    def run(self) -> FleetResult:
        """Simulate until the trainer has its iterations (or a limit cuts the run).

        The run allocates millions of small objects, almost none of them cyclic garbage, and
        keeps a heap that grows with the fleet (requests, sessions, records). Python's cyclic
        collector runs a young pass every 700 net allocations and a full pass over the whole
        heap up to every 100 young ones, so its cost grows as allocations × heap, faster than
        the fleet (16 s of a 128-engine run of benchmarks/scale.py, 1.7 s at 32 engines).
        During the run the young threshold is raised (broker/gc_tuning.py)."""
        if self.policy is None:
            raise SimulationError("policy: set a policy before running the simulation")
        with few_collections():
            return self._run()

    def _run(self) -> FleetResult:
        limits = self.scenario.limits
        wall0 = time.monotonic()
        if not self.policy.dispatch_on_arrival:
            self._agent_view = set(self.idle_timeout_s)
        self._enqueue_from_trainer()
        for i, change in enumerate(self.scenario.fleet.changes):
            self._schedule(change.at_s, _FLEET, str(i))
        self._heartbeat()
        self._schedule(self.heartbeat_s, _HEARTBEAT, "")
        self._maybe_decide()
        idle_beats = 0
        while not self.trainer.done:
            t_eng, eng_id = self._next_engine_event()
            t_ext = self._events[0][0] if self._events else float("inf")
            t = min(t_eng, t_ext)
            if t > limits.max_sim_time_s or time.monotonic() - wall0 > limits.max_wall_s:
                break
            self.now = max(self.now, t)
            if t_eng <= t_ext:
                for req in self.engines[eng_id].advance(t_eng):
                    self._on_turn_finished(req)
            else:
                _, kind, _, sid = heapq.heappop(self._events)
                if kind == _HEARTBEAT:
                    if self.trainer.stalled():
                        break  # a finite trace ran dry before the iterations were complete
                    stuck = (self._fleet_idle() and any(self.pending.values())
                             and self._pause is None)
                    idle_beats = idle_beats + 1 if stuck else 0
                    if idle_beats > 120:
                        raise SimulationError(
                            f"policy {self.policy.name!r} admitted nothing for 120 s while "
                            f"{sum(map(len, self.pending.values()))} sessions were pending and the fleet was idle"
                        )
                    self._heartbeat()
                    self._schedule(self.now + self.heartbeat_s, _HEARTBEAT, "")
                elif kind == _TELEMETRY:
                    self._deliver(*self._beats.popleft())
                elif kind == _TOOL_RETURN:
                    self._on_tool_return(self.live[sid])
                elif kind == _ARRIVAL:
                    self._arrival_at = None
                    self._enqueue_from_trainer()
                elif kind == _TRAINED:
                    self._on_trained()
                elif kind == _RESUME:
                    self._resume()
                elif kind == _PARK:
                    self._on_idle_timeout(self.live[sid])
                elif kind == _FLEET:
                    self._on_fleet_change(int(sid))
                elif kind == _CUT:
                    self._cut_engine(sid)
                elif kind == _LORA:
                    self._on_adapter_loaded(sid)
                else:
                    self._on_result(self.live.pop(sid))
            if self._pause is not None and self._pause.paused_at is None:
                self._check_paused()  # abort, wait: the last request in flight may have ended
            # Handle everything else due at this instant before asking the policy.
            if self._events and self._events[0][0] <= self.now:
                continue
            self._maybe_decide()
        return self._result()

    def _fleet_idle(self) -> bool:
        return all(not e.scheduler.running and not e.scheduler.waiting for e in self.engines.values()) \
            and not any(k == _TOOL_RETURN for _, k, _, _ in self._events)

    def _schedule(self, at: float, kind: int, sid: str) -> None:
        heapq.heappush(self._events, (at, kind, next(self._seq), sid))

    # -- the engines' next event times -------------------------------------------------------
    def _engine_notifier(self, b: str) -> Callable[[], None]:
        return lambda: self._engine_changed(b)

    def _engine_changed(self, b: str) -> None:
        """Engine `b` may have a new next event time (`EngineCore.on_change`)."""
        engine = self.engines[b]
        if engine.has_unfinished():
            self._unfinished.add(b)
        else:
            self._unfinished.discard(b)
        t = engine.next_event_time()
        if t != self._next_at[b]:
            self._next_at[b] = t
            if t is not None:
                heapq.heappush(self._engine_heap, (t, b))

    def _next_engine_event(self) -> tuple[float, str]:
        """(time, engine id) of the earliest engine event, (inf, "") when no engine has one."""
        heap, next_at = self._engine_heap, self._next_at
        while heap and next_at[heap[0][1]] != heap[0][0]:
            heapq.heappop(heap)  # stale: the engine's time has moved since
        found = heap[0] if heap else (float("inf"), "")
        if self.check:
            scan = min(((t, b) for b, e in self.engines.items() if (t := e.next_event_time()) is not None),
                       default=(float("inf"), ""))
            if scan != found:
                raise SimulationError(f"check: the next-event heap gives {found}, a scan of the "
                                      f"engines {scan} (at {self.now})")
        return found

    # -- the trainer side ------------------------------------------------------------------
    def _enqueue_from_trainer(self) -> None:
        for sim in self.trainer.enqueue(self.now):
            self.enqueued.append((sim, self.now))
            live = _Live(sim, enqueued_at=self.now, history=list(sim.session.prompt_token_ids))
            self.live[sim.session_id] = live
            self._make_pending(live)
        # A recorded trace's next arrival is an event of its own (results may never come).
        nxt = self.trainer.next_arrival_at()
        if nxt is not None and nxt != self._arrival_at:
            self._arrival_at = nxt
            self._schedule(max(nxt, self.now), _ARRIVAL, "")

    def _make_pending(self, live: _Live, requeue: bool = False) -> None:
        """A session (or, for a router, a follow-up turn) the policy may place. A broker sees
        a session a pause stopped as new, as the live broker sees a requeued partial rollout:
        its prompt is the conversation so far, and it may go to any backend. `requeue` (a
        parked agent-driven episode's next call): at the front of its workload's queue with its
        original enqueue time, the calls it has left as its turns, as broker/episodes.py queues
        it (requeue.lua keeps the enqueue time)."""
        s = live.sim.session
        prompt = live.history
        turn = live.turn if self.policy.dispatch_on_arrival else 0
        item = PendingItem(
            session_id=s.session_id, workload=s.workload, group_id=s.group_id,
            group_size=s.group_size, prompt_tokens=len(prompt), prefix=tuple(prompt),
            max_tokens=s.max_tokens - len(live.partial),
            max_turns=max(1, s.max_turns - live.turn) if requeue else s.max_turns, turn=turn,
            home_backend=live.backend if turn else None,
            enqueued_at=live.enqueued_at if requeue else self.now, adapter=s.adapter,
        )
        if requeue:
            self.pending[s.workload].appendleft(item)
        else:
            self.pending[s.workload].append(item)
        self._pending_ids.add(s.session_id)
        self._dirty = True

    # -- the policy ------------------------------------------------------------------------
    def _maybe_decide(self) -> None:
        if not self._dirty or not any(self.pending.values()) or self._pause is not None:
            return  # (paused: the trainer and the broker send nothing until the resume)
        self._dirty = False
        snapshot = Snapshot(
            now=self.now,
            pending={w: tuple(q) for w, q in self.pending.items()},
            backends=self._backend_views(),
            mixture_target=self.trainer.mixture,
            consumed=dict(self.trainer.consumed),
            new_completions=tuple(self.completions),
        )
        self.learned.extend(self.completions)
        self.completions = []
        self.decide_calls += 1
        self._apply(self.policy.decide(snapshot))

    def _backend_views(self) -> tuple[BackendView, ...]:
        """Every visible backend's view, in engine order: the last decide's, but built again
        for the backends marked stale since."""
        if self._stale_views or self._views_tuple is None:
            views, pos = self._views, self._view_pos
            for b in self._stale_views:
                i = pos.get(b)
                if i is not None:  # (not a leaving or joining engine's)
                    views[i] = self._backend_view(b)
            self._stale_views.clear()
            self._views_tuple = tuple(views)
        if self.check:
            fresh = tuple(self._backend_view(b) for b in self.members.visible)
            if fresh != self._views_tuple:
                wrong = [f.backend_id for f, v in zip(fresh, self._views_tuple) if f != v]
                raise SimulationError(f"check: stale backend views for {wrong} (at {self.now})")
        return self._views_tuple

    def _backend_view(self, b: str) -> BackendView:
        engine = self.engines[b]
        return BackendView(
            backend_id=b, capacity_tokens=engine.num_gpu_blocks * engine.block_size,
            max_model_len=engine.max_model_len, healthy=True, alpha=self.ledger[b].alpha,
            telemetry=self.telemetry.get(b), sessions=tuple(self.resident[b].values()),
            max_loras=self.scenario.fleet.max_loras,
            adapters=frozenset(self._loaded[b]) if self._slots else frozenset(),
        )

    def _apply(self, decision: Decision) -> None:
        """The broker's rule (`broker.decision.apply_decision`): α, then recharges, then the
        admissions the ledger has room for; a refused admission stays pending."""
        if self.check and self._pending_ids != {p.session_id for q in self.pending.values() for p in q}:
            raise SimulationError(f"check: the pending-id set differs from the pending queues (at {self.now})")
        placed: set[str] = set()
        for adm in decision.admissions:
            live = self.live.get(adm.session_id)
            if live is None or adm.backend_id not in self.engines:
                raise SimulationError(f"policy {self.policy.name!r} admitted unknown "
                                      f"session {adm.session_id!r} or backend {adm.backend_id!r}")
            if adm.session_id not in self._pending_ids or adm.session_id in placed:
                raise SimulationError(f"policy {self.policy.name!r} admitted a session that was not pending")
            placed.add(adm.session_id)
        enforce = not self.policy.dispatch_on_arrival
        expected = apply_decision(decision, full := copy.deepcopy(self.ledger), enforce) if self.check else None
        applied = apply_decision(decision, self._ledgers_for(decision), enforce)
        if self.check and (applied != expected or self.ledger != full):
            raise SimulationError(f"check: the decision applied to the ledger entries it touches "
                                  f"differs from it applied to the whole ledger (at {self.now})")
        self._stale_views.update(applied.alpha)
        for sid, (b, tokens) in applied.recharge.items():
            live = self.live[sid]
            live.reserved = tokens
            self._update_resident(live)
            seen = self.resident[b].get(sid)
            if seen is not None:  # the ledger changes at once; progress waits for a beat
                self.resident[b][sid] = replace(seen, reserved_tokens=tokens)
                self._stale_views.add(b)
        admitted: dict[str, set[str]] = {}
        for adm in applied.admissions:
            live = self.live[adm.session_id]
            admitted.setdefault(live.sim.workload, set()).add(adm.session_id)
            if live.admitted_at is None:
                live.admitted_at = self.now
            live.backend = adm.backend_id
            live.reserved = adm.reserved_tokens
            live.placed_prompt = len(live.history)
            live.placed_turns = max(1, live.sim.session.max_turns - live.turn)
            live.placed_at = self.now
            self._submit_turn(live)
        for w, ids in admitted.items():
            self.pending[w] = deque(p for p in self.pending[w] if p.session_id not in ids)
            self._pending_ids -= ids

    def _ledgers_for(self, decision: Decision) -> dict[str, LedgerEntry]:
        """The ledger entries `decision` can touch, in engine order: those of its α changes, of
        its admissions, and of the backends its recharged sessions are charged on. A session is
        charged on one backend at most, its `_Live.backend` (it is released before it is pending
        again), so `apply_decision` reads the same entries as from the whole ledger without
        indexing every resident session of the fleet on every decide. (A joining or leaving
        engine's entry refuses admissions: `LedgerEntry.healthy` is off.)"""
        def charged_on(sid: str) -> str | None:
            live = self.live.get(sid)
            return live.backend if live is not None else None

        touched, _ = touched_backends(decision, charged_on)
        order = self.members.order
        mine = sorted(touched & self.ledger.keys(), key=order.__getitem__)
        return {b: self.ledger[b] for b in mine}

    # -- sessions on engines ---------------------------------------------------------------
    def _submit_turn(self, live: _Live) -> None:
        sim = live.sim
        prompt = live.history
        live.waiting_on_tool = False
        if live.backend in self.members.cut or live.backend in self.members.gone:
            raise SimulationError(f"session {sim.session_id}: a turn submitted to engine "
                                  f"{live.backend}, which has left (at {self.now})")
        if self._pause is not None:
            self._held.append(live)  # the engine is paused: the request starts on resume
            self._update_resident(live)
            return
        adapter = sim.session.adapter
        if adapter is not None and self._slots and not live.slot_held:
            if not self._slots[live.backend].submit(adapter, live):
                live.slot_wait_since = self.now  # every slot is another adapter's: it waits
                self._lora_totals["slot_waits"] += 1
                self._update_resident(live)
                return
            live.slot_held = True
        self._start_turn(live)

    def _start_turn(self, live: _Live) -> None:
        """The turn's request goes to the engine, once its adapter (if any) has loaded there
        (a turn whose slot or load came during a weight update's pause waits for the resume)."""
        if self._pause is not None:
            if live.slot_held:
                self._release_adapter_slot(live)
            self._held.append(live)
            self._update_resident(live)
            return
        adapter = live.sim.session.adapter
        if adapter is not None and self._slots and not self._adapter_ready(live):
            self._update_resident(live)
            return
        sim = live.sim
        prompt = live.history
        kept = len(live.partial)  # a stopped turn resumes: prompt + its output so far
        live.resuming = kept > 0
        req = EngineRequest(
            request_id=f"{sim.session_id}#{live.turn}" + (f"+{kept}" if kept else ""),
            prompt_token_ids=prompt, max_tokens=sim.session.max_tokens - kept,
            output_len=sim.truth.output_tokens[live.turn] - kept,
            seed=sim.truth.token_seed * 1000 + live.turn, arrival_time=self.now,
            prefix_block_hashes=live.history_hashes, priority=self._priority(live),
        )
        live.request = req
        live.prompt_len = len(prompt)
        self.by_request[req.request_id] = live
        self.engines[live.backend].add_request(req)
        self._update_resident(live)

    def _priority(self, live: _Live) -> int:
        """The request priority a turn carries (`fleet.scheduling_policy`): a broker's worker
        sends its session's latest admission time in milliseconds (its admitted entry's id),
        so an engine scheduling by priority serves older sessions first and preempts the
        youngest; a router sends none."""
        if self.policy.dispatch_on_arrival:
            return 0
        return int(live.placed_at * 1000)

    def _on_turn_finished(self, req: EngineRequest) -> None:
        live = self.by_request.pop(req.request_id)
        live.request = None
        if live.slot_held:
            self._release_adapter_slot(live)
        live.engine_tokens += req.num_output_tokens
        if live.resuming and req.num_cached_tokens >= 0:
            recomputed = req.num_prompt_tokens - req.num_cached_tokens
            totals = self._scale_totals if live.partial_from_scale_in else self._update_totals
            totals["reprefill_tokens"] += recomputed
        if req.finish_reason is FinishReason.abort:
            self._on_turn_stopped(live, req)
            return
        live.parked_context = live.prompt_len + req.num_output_tokens  # KV it holds while parked
        live.outputs.append(live.partial + req.output_token_ids)
        live.generated += len(live.outputs[-1])
        live.partial = []
        live.cached_tokens += max(0, req.num_cached_tokens)
        live.truncated |= req.finish_reason is FinishReason.length
        if live.first_token_at is None:
            live.first_token_at = req.first_token_time
        if req.finish_time is not None:  # the turn, submission to last token
            live.kv_turns.append((live.prompt_len, req.num_output_tokens,
                                  req.finish_time - req.arrival_time))
        live.turn += 1
        truth = live.sim.truth
        if live.turn < truth.turns:
            # Turn k+1's prompt is turn k's prompt, its output and the tool's observation; the
            # hashes of the blocks the engine already computed carry over.
            live.history = (live.history + req.output_token_ids
                            + truth.observation_token_ids(live.turn - 1))
            live.history_hashes = req.block_hashes  # all within prompt + output tokens
            wait = truth.tool_latency_s[live.turn - 1]
            live.tool_wait_s += wait
            live.kv_waits.append((live.prompt_len + req.num_output_tokens, wait))
            live.waiting_on_tool = True
            self._update_resident(live)
            self._schedule(self.now + wait, _TOOL_RETURN, live.sim.session_id)
            if self.policy.dispatch_on_arrival:
                self._release(live)  # a router forgets a request once it is answered
            else:
                timeout = self.idle_timeout_s.get(live.sim.workload)
                if timeout is not None and wait > timeout:  # no call within the timeout
                    self._schedule(self.now + timeout, _PARK, live.sim.session_id)
                if live.backend in self.members.cut:  # its engine is leaving: go on elsewhere
                    self._hand_back_between_turns(live)
            return
        self._release(live)
        self.completions.append(Completion(
            session_id=live.sim.session_id, workload=live.sim.workload, backend_id=live.backend,
            prompt_tokens=len(live.sim.session.prompt_token_ids), output_tokens=sum(map(len, live.outputs)),
            turn_output_tokens=tuple(map(len, live.outputs)), turns=live.turn,
            tool_wait_s=live.tool_wait_s,
            kv_token_seconds=kv_token_seconds(live.kv_turns, live.kv_waits),
            admitted_at=live.admitted_at, finished_at=self.now, truncated=live.truncated,
        ))
        self._dirty = True
        self._schedule(self.now + truth.final_latency_s, _RESULT, live.sim.session_id)

    def _on_turn_stopped(self, live: _Live, req: EngineRequest) -> None:
        """A pause with mode=abort, or an engine leaving the fleet, stopped the turn: the
        session goes back to pending, to resume from its output so far (a partial rollout: its
        prompt grows by that output, which is prefilled again) or, after a pause with
        `partial: false`, to run the turn again. A leaving engine always hands its sessions
        back with their output (the live worker's drain, workers/runner.py `Handoff`), to the
        front of the queue with their enqueue time, as requeue.lua puts them."""
        n = req.num_output_tokens
        live.cached_tokens += max(0, req.num_cached_tokens)
        if n and live.first_token_at is None:
            live.first_token_at = req.first_token_time
        if req.finish_time is not None and req.num_cached_tokens >= 0:
            live.kv_turns.append((live.prompt_len, n, req.finish_time - req.arrival_time))
        scale_in = live.backend in self.members.cut
        if scale_in or self.weight_update.partial:
            live.partial += req.output_token_ids
            live.history = live.history + req.output_token_ids
            live.history_hashes = req.block_hashes
            live.partial_from_scale_in = scale_in
            totals = self._scale_totals if scale_in else self._update_totals
            totals["tokens_handed_back" if scale_in else "tokens_kept"] += n
        else:
            live.thrown_away += n
            self._update_totals["tokens_thrown_away"] += n
        self._release(live)
        if scale_in:
            self._count_hand_back(live)
        self._make_pending(live, requeue=scale_in)

    # -- LoRA adapters (fleet.max_loras) ---------------------------------------------------
    def _adapter_ready(self, live: _Live) -> bool:
        """Whether the turn's adapter is loaded on its engine (now the most recently used);
        else its load starts (or is under way) and the turn starts when it ends."""
        b, adapter = live.backend, live.sim.session.adapter
        loaded = self._loaded[b]
        if adapter in loaded:
            loaded.move_to_end(adapter)
            return True
        key = f"{b}|{adapter}"
        waiting = self._loading.setdefault(key, [])
        if not waiting:
            self._schedule(self.now + self.scenario.fleet.lora_load_s, _LORA, key)
        waiting.append(live)
        live.loading = True
        return False

    def _on_adapter_loaded(self, key: str) -> None:
        """An adapter has loaded on an engine: it joins the engine's loaded adapters (the least
        recently used one no request holds goes, past `max_loras` of them) and the turns that
        waited for it start."""
        b, adapter = key.split("|", 1)
        waiting = self._loading.pop(key, [])
        if b not in self._loaded or b in self.members.cut:
            return  # the engine left (its turns were handed back)
        loaded = self._loaded[b]
        loaded[adapter] = None
        running = self._slots[b].running
        for old in list(loaded):
            if len(loaded) <= self.scenario.fleet.max_loras:
                break
            if old != adapter and old not in running:
                del loaded[old]
        self._lora_totals["loads"] += 1
        self._stale_views.add(b)
        for live in waiting:
            if live.loading and live.backend == b:
                live.loading = False
                self._start_turn(live)

    def _release_adapter_slot(self, live: _Live) -> None:
        """The turn's request left the engine: its adapter slot goes back, and turns that waited
        for one start (on an engine the grace has ended for, its cut hands them back)."""
        b = live.backend
        live.slot_held = False
        for other in self._slots[b].release(live.sim.session.adapter):
            self._lora_totals["slot_wait_s"] += self.now - other.slot_wait_since
            other.slot_wait_since = None
            other.slot_held = True
            if b not in self.members.cut:
                self._start_turn(other)

    def _drop_adapter_wait(self, live: _Live) -> None:
        """A turn that had not started leaves its engine (handed back): out of the slot queue and
        the load it waited for, its slot (if it held one) given back."""
        b = live.backend
        if live.slot_wait_since is not None:
            self._slots[b].cancel(live)
            live.slot_wait_since = None
        if live.loading:
            key = f"{b}|{live.sim.session.adapter}"
            self._loading[key] = [w for w in self._loading.get(key, []) if w is not live]
            live.loading = False
        if live.slot_held:
            self._release_adapter_slot(live)

    # -- engines joining and leaving (fleet.changes) ----------------------------------------
    def _on_fleet_change(self, index: int) -> None:
        change = self.scenario.fleet.changes[index]
        if change.add is not None:
            for _ in range(change.add):
                self._add_engine()
            return
        for b in self.members.victims(change.remove):
            self._begin_leaving(b, change.drain_grace_s or 0.0)

    def _new_engine(self, healthy: bool = True) -> str:
        """Engine `e<N>` (N: the engines made so far; seeded the scenario's seed + N), with its
        ledger entry (admitting or not, by `healthy`), its event times and, with LoRA, its
        adapter slots. Returns its backend id."""
        i = len(self.engines)
        b = f"e{i}"
        fleet = self.scenario.fleet
        engine = self.engines[b] = EngineCore(self._profile, kv_tokens=fleet.kv_tokens,
                                              seed=self.scenario.seed + i,
                                              scheduling_policy=fleet.scheduling_policy)
        self.resident[b], self._progress[b] = {}, {}
        self.ledger[b] = LedgerEntry(capacity_tokens=engine.num_gpu_blocks * engine.block_size,
                                     healthy=healthy)
        self._next_at[b] = None
        engine.on_change = self._engine_notifier(b)
        self._engine_changed(b)
        if fleet.max_loras:
            self._slots[b] = AdapterSlots(fleet.max_loras)
            self._loaded[b] = OrderedDict()
        return b

    def _add_engine(self) -> None:
        """A worker pod starts with a fresh engine and backend id. It registers its ledger
        entry at once (refusing admissions: `healthy` off) and is in the policy's snapshot from
        its first heartbeat delivered (`_beats_of_members`)."""
        self.members.join(self._new_engine(healthy=False), self.now)
        self._scale_totals["engines_joined"] += 1

    def _beats_of_members(self, telemetry: dict[str, Telemetry],
                          progress: dict[str, dict[str, ResidentSession]],
                          ) -> tuple[dict[str, Telemetry], dict[str, dict[str, ResidentSession]]]:
        """A delivered beat, less the engines that left since it was taken; an engine whose
        first beat this is joins the snapshot (and its ledger entry admits)."""
        members = self.members
        telemetry = {b: t for b, t in telemetry.items() if members.serving(b)}
        progress = {b: p for b, p in progress.items() if members.serving(b)}
        joined = [b for b in telemetry if members.seen(b)]
        for b in joined:
            self.ledger[b].healthy = True
        if joined:
            self._visible_changed()
        return telemetry, progress

    def _visible_changed(self) -> None:
        """An engine joined or left the snapshot: index the views again, keeping those of the
        engines that stay."""
        kept = {b: self._views[i] for b, i in self._view_pos.items()}
        visible = self.members.visible
        self._view_pos = {b: i for i, b in enumerate(visible)}
        self._views = [kept.get(b) for b in visible]
        self._stale_views.update(b for b in visible if kept.get(b) is None)
        self._views_tuple = None
        self._dirty = True

    def _begin_leaving(self, b: str, grace_s: float) -> None:
        """SIGTERM to a worker pod: from now on it takes no admission (it leaves the snapshot and
        its ledger entry refuses them), its sessions run on for `grace_s`, then the rest are
        cut (`_cut_engine`). It has left once nothing of it remains in the ledger."""
        self.members.leave(b)
        self.ledger[b].healthy = False
        self.telemetry.pop(b, None)
        self._visible_changed()
        if grace_s > 0:
            self._schedule(self.now + grace_s, _CUT, b)
            self._leave_if_empty(b)
        else:
            self._cut_engine(b)

    def _cut_engine(self, b: str) -> None:
        """The drain grace of `b` is over: every session still on it goes back to the queue with
        what it has, as the live worker hands its sessions back (workers/runner.py `Handoff`,
        `Session.resume_from`). A turn on the engine is aborted at the next step boundary and
        its session resumes from the output so far (`_on_turn_stopped`); a turn that
        completes in that step, or a session between turns, goes on elsewhere at its next
        turn (`_hand_back_between_turns`); a turn held by a weight update's pause is queued."""
        if not self.members.start_cut(b):
            return  # it emptied during the grace and has left
        engine = self.engines[b]
        engine.settle(self.now)
        engine.abort_all()
        for req in engine.advance(self.now):
            self._on_turn_finished(req)
        if b not in self.members.leaving:
            return
        for sid in list(self.ledger[b].sessions):
            live = self.live[sid]
            if live.request is not None:
                continue  # its abort ends the step in flight (`_on_turn_finished` then)
            if live.waiting_on_tool:
                self._hand_back_between_turns(live)
            else:  # held by a pause, or waiting for an adapter slot or load: not started
                self._held = [h for h in self._held if h is not live]
                self._drop_adapter_wait(live)
                live.reserved = 0
                self._release(live)
                self._count_hand_back(live)
                self._make_pending(live, requeue=True)
            if b not in self.members.leaving:
                return
        self._leave_if_empty(b)

    def _hand_back_between_turns(self, live: _Live) -> None:
        """A session between turns on an engine that leaves: released now; its next turn (when
        its tool returns) is queued to be admitted again, with the conversation so far."""
        live.parked = True
        live.reserved = 0
        self._release(live)
        self._count_hand_back(live)

    def _count_hand_back(self, live: _Live) -> None:
        live.handed_back += 1
        self._scale_totals["sessions_handed_back"] += 1

    def _leave_if_empty(self, b: str) -> None:
        """A leaving engine with no session left in its ledger has left the fleet."""
        if self.ledger[b].sessions:
            return
        if self.engines[b].has_unfinished():
            raise SimulationError(f"engine {b} leaves with requests of no session (at {self.now})")
        self.members.left(b, self.now)
        del self.ledger[b], self.resident[b], self._progress[b]
        self._scale_totals["engines_left"] += 1

    def _account_tokens(self, live: _Live, record: SessionRecord) -> None:
        """Every output token an engine generated for a delivered session is in its result,
        but those a pause with `partial: false` threw away. What else is missing from a result
        was generated again: counted as lost to scale-in for a session a leaving engine handed
        back, and a bug anywhere else (raised under `check`)."""
        missing = live.engine_tokens - live.thrown_away - record.output_tokens
        if live.handed_back:
            self._scale_totals["tokens_lost_to_scale_in"] += missing
        elif self.check and missing:
            raise SimulationError(f"check: session {record.session_id}: its engines generated "
                                  f"{missing} output tokens its result lacks (at {self.now})")

    # -- weight updates --------------------------------------------------------------------
    def _on_iteration(self, it: IterationRecord) -> None:
        if self.weight_update is not None and not self.trainer.done:
            self._untrained += 1
            self._train_next()
        if self.on_iteration is not None:
            self.on_iteration(it)

    def _train_next(self) -> None:
        """The trainer works one batch at a time, as RL trainers do: train for `train_s`, push
        the weights after every `every`-th batch (the engines pause meanwhile), then take the
        next batch if one is waiting."""
        if not self._trainer_busy and self._untrained:
            self._untrained -= 1
            self._trainer_busy = True
            self._schedule(self.now + self.scenario.trainer.train_s, _TRAINED, "")

    def _on_trained(self) -> None:
        self._trained += 1
        self._trainer_busy = False
        if self._trained % self.weight_update.every == 0:
            self._trainer_busy = True  # until the resume
            self._start_pause()
        else:
            self._train_next()

    def _start_pause(self) -> None:
        """Pause every engine with the scenario's mode (vLLM's `POST /pause?mode=`): keep
        freezes each engine where it is, abort stops every request at the next step boundary,
        wait lets them finish. Turns submitted from now on wait for the resume."""
        self._pause = _Pause(started_at=self.now)
        mode = self.weight_update.mode
        for engine in self.engines.values():
            if mode == "keep":
                engine.freeze(self.now)
            else:
                engine.settle(self.now)
                if mode == "abort":
                    engine.abort_all()
            for req in engine.advance(self.now):  # what finished or stopped by now
                self._on_turn_finished(req)
        if mode == "keep":
            self._paused()
        else:
            self._check_paused()

    def _check_paused(self) -> None:
        if self.check and self._unfinished != {b for b, e in self.engines.items() if e.has_unfinished()}:
            raise SimulationError(f"check: the set of engines with unfinished requests is stale (at {self.now})")
        if not self._unfinished:
            if self.weight_update.clear_cache:
                for engine in self.engines.values():
                    engine.reset_prefix_cache()
            self._paused()

    def _paused(self) -> None:
        """Every engine is paused: the trainer loads the new weights, then resumes them."""
        self._pause.paused_at = self.now
        self._schedule(self.now + self.weight_update.sync_s, _RESUME, "")

    def _resume(self) -> None:
        pause, self._pause = self._pause, None
        totals = self._update_totals
        totals["updates"] += 1
        totals["paused_s"] += self.now - pause.started_at
        totals["drain_s"] += pause.paused_at - pause.started_at
        for engine in self.engines.values():
            if self.weight_update.mode == "keep":
                engine.unfreeze(self.now)
        held, self._held = self._held, []
        for live in held:
            self._submit_turn(live)
        self._dirty = True
        self._trainer_busy = False
        self._train_next()

    def _on_tool_return(self, live: _Live) -> None:
        if self.policy.dispatch_on_arrival:
            self._make_pending(live)  # the router sees the next turn as a new request
        elif live.parked:
            live.parked = live.waiting_on_tool = False  # its next call: admitted again
            self._make_pending(live, requeue=True)
        else:
            self._submit_turn(live)  # the worker (or the gateway) runs it on the same engine

    def _on_idle_timeout(self, live: _Live) -> None:
        """An agent-driven episode made no call for `idle_timeout_s`: the gateway parks it and
        the ledger releases its charge (the engine's prefix cache keeps what it keeps)."""
        if live.request is not None or not live.waiting_on_tool or live.parked:
            return  # its call came at this very instant
        live.parked = True
        live.reserved = 0
        self.parked += 1
        self._release(live)

    def _on_result(self, live: _Live) -> None:
        sim = live.sim
        record = SessionRecord(
            session_id=sim.session_id, workload=sim.workload, enqueued_at=live.enqueued_at,
            admitted_at=live.admitted_at, first_token_at=live.first_token_at, finished_at=self.now,
            prompt_tokens=len(sim.session.prompt_token_ids), output_tokens=sum(map(len, live.outputs)),
            cached_tokens=live.cached_tokens, turns=live.turn,
        )
        self.records.append(record)
        self._account_tokens(live, record)
        for it in self.trainer.on_result(record, self.now):
            self._on_iteration(it)
        self._enqueue_from_trainer()

    # -- the ledger view -------------------------------------------------------------------
    def _update_resident(self, live: _Live, decoded: int = 0) -> None:
        """Record the session's progress as its worker knows it now (`telemetry.progress`;
        `decoded`: steps of its engine's decode run in flight not yet in its request). The
        policy sees a newly admitted session at once (the ledger), and its progress from the
        next heartbeat delivered after this."""
        s = live.sim.session
        req = live.request
        if s.workload in self._agent_view:
            # No worker reports an agent-driven episode: the ledger's charge, and the rest as
            # at its admission (broker/snapshot.py, a resident session without progress).
            n = live.placed_prompt
            now = self._progress[live.backend][s.session_id] = ResidentSession(
                session_id=s.session_id, workload=s.workload, group_id=s.group_id,
                reserved_tokens=live.reserved, prompt_tokens=n, context_tokens=n,
                generated_tokens=0, turn=0, max_tokens=s.max_tokens, max_turns=live.placed_turns,
                waiting_on_tool=False, admitted_at=live.placed_at, adapter=s.adapter,
            )
        else:
            out_now = req.num_output_tokens + decoded if req is not None and self.streamed else 0
            now = self._progress[live.backend][s.session_id] = ResidentSession(
                session_id=s.session_id, workload=s.workload, group_id=s.group_id,
                reserved_tokens=live.reserved, prompt_tokens=len(s.prompt_token_ids),
                context_tokens=live.prompt_len + out_now if req is not None else live.parked_context,
                generated_tokens=live.generated + len(live.partial) + out_now,
                turn=live.turn + (1 if req is not None else 0), max_tokens=s.max_tokens,
                max_turns=s.max_turns, waiting_on_tool=live.waiting_on_tool,
                admitted_at=live.admitted_at if live.admitted_at is not None else self.now,
                adapter=s.adapter,
            )
        seen = self.resident[live.backend]
        if self.lag_s == 0 or s.session_id not in seen:
            seen[s.session_id] = now
            self._stale_views.add(live.backend)

    def _release(self, live: _Live) -> None:
        b = live.backend
        self.ledger[b].release(live.sim.session_id)
        if self.resident[b].pop(live.sim.session_id, None) is not None:
            self._stale_views.add(b)
        self._progress[b].pop(live.sim.session_id, None)
        self._dirty = True
        if b in self.members.leaving:
            self._leave_if_empty(b)

    def _heartbeat(self) -> None:
        """What workers report once per heartbeat: engine metrics and session progress, taken
        now and delivered `lag_s` later."""
        telemetry: dict[str, Telemetry] = {}
        progress: dict[str, dict[str, ResidentSession]] = {}
        members = self.members
        for b, engine in self.engines.items():
            if b in members.gone:
                continue
            st = engine.stats(self.now)  # (a decode run in flight: the steps done by now)
            self.kv_samples.append(KvSample(at=self.now, engine_id=b, usage=st.kv_usage,
                                            preemptions_total=st.num_preemptions_total))
            if b in members.leaving:
                continue  # a draining worker's beats no longer reach the policy
            telemetry[b] = Telemetry(
                at=self.now, kv_usage=st.kv_usage, running=st.num_running, waiting=st.num_waiting,
                preemptions_total=st.num_preemptions_total,
                prefix_queries_total=st.prefix_queries_total, prefix_hits_total=st.prefix_hits_total,
            )
            if not self.policy.reads_progress:
                continue
            # Only requests the engine is running make progress, and a worker learns it only
            # when it streams; parked sessions and queued requests report what they reported
            # before.
            truth = self._progress[b]
            if self.streamed:
                decoded = engine.decoded_by(self.now)
                for req in engine.scheduler.running:
                    session = self.by_request[req.request_id]
                    if session.sim.workload in self._agent_view:
                        continue  # no worker runs it: nothing to report
                    rs = truth.get(session.sim.session_id)
                    generated = (req.num_output_tokens + decoded + session.generated
                                 + len(session.partial))
                    if rs is None or generated != rs.generated_tokens:
                        self._update_resident(session, decoded)
            progress[b] = dict(truth)
        if self.lag_s == 0:
            self._deliver(telemetry, progress)
        else:
            self._beats.append((telemetry, progress))
            self._schedule(self.now + self.lag_s, _TELEMETRY, "")

    def _deliver(self, telemetry: dict[str, Telemetry],
                 progress: dict[str, dict[str, ResidentSession]]) -> None:
        """A heartbeat reaches the broker: its metrics, and the progress of the sessions that
        are still resident (with the ledger's reservation as it is now). An engine's first
        beat puts it in the snapshot; the beats of one that left since they were taken are
        dropped."""
        if self.scenario.fleet.changes:
            telemetry, progress = self._beats_of_members(telemetry, progress)
        self.telemetry.update(telemetry)
        self._stale_views.update(telemetry)  # (and `progress` is of backends among these)
        for b, sessions in progress.items():
            seen = self.resident[b]
            for sid, rs in sessions.items():
                cur = seen.get(sid)
                if cur is not None:
                    seen[sid] = replace(rs, reserved_tokens=cur.reserved_tokens)
        self._dirty = True

    # -- results ---------------------------------------------------------------------------
    def _result(self) -> FleetResult:
        engines = []
        for b, e in self.engines.items():
            st = e.stats()
            engines.append(EngineCounters(engine_id=b, prefix_queries=st.prefix_queries_total,
                                          prefix_hits=st.prefix_hits_total,
                                          preemptions=st.num_preemptions_total))
        iterations = self.trainer.iterations
        end = iterations[-1].done_at if iterations else self.now
        if not iterations or end <= 0:
            raise SimulationError(
                f"policy {self.policy.name!r}: no iteration completed within the scenario's limits "
                f"(simulated {self.now:.0f} s)")
        first_fill: dict[str, int] = {}
        for sim, at in self.enqueued:
            if at <= 0.0:
                first_fill[sim.workload] = first_fill.get(sim.workload, 0) + 1
        changes = bool(self.scenario.fleet.changes)
        metrics = summarize(self.records, iterations, engines, self.kv_samples,
                            self.trainer.mixture, 0.0, end, self.scenario.trainer.batch_size,
                            first_fill, present=self.members.present if changes else None)
        if self.weight_update is not None:
            metrics = replace(metrics, weight_updates=WeightUpdateStats(**self._update_totals))
        if changes:
            metrics = replace(metrics, scale=ScaleStats(**self._scale_totals))
        if self._slots:
            metrics = replace(metrics, lora=LoraStats(**self._lora_totals))
        return FleetResult(
            policy=self.policy.name, metrics=metrics, iterations=list(iterations),
            sessions=list(self.records), kv_samples=self.kv_samples, engines=engines,
            completed=self.trainer.done, sim_time_s=self.now, decide_calls=self.decide_calls,
            parked=self.parked, completions=tuple(self.learned),
        )
