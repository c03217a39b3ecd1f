"""Run metrics as docs/measurement.md defines them, and the trainer that consumes results.

Pure functions on plain records: the fleet simulator fills `SessionRecord`, `EngineCounters` and
`KvSample`; the `Trainer` turns finished sessions into `IterationRecord`s. Nothing here knows
about engines or the event loop, so each definition is tested on numbers worked out by hand.
"""

from __future__ import annotations

import math

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from broker.mixture import mixture_drift, quotas
from sim.scenario import Scenario
from sim.workloads.source import SessionSource
from sim.workloads.truth import SimSession


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """One finished session, as the trainer receives it. Times are simulator seconds."""

    session_id: str
    workload: str
    enqueued_at: float  # the trainer put it in the pending queue
    admitted_at: float  # a policy placed it on a backend (router baselines: = enqueued_at)
    first_token_at: float  # its first output token was produced
    finished_at: float  # its result reached the trainer (after the final reward/test latency)
    prompt_tokens: int  # first-turn prompt length
    output_tokens: int  # generated, summed over turns
    cached_tokens: int  # prompt tokens served from the prefix cache, summed over turns
    turns: int

    @property
    def latency(self) -> float:
        return self.finished_at - self.enqueued_at


@dataclass(frozen=True, slots=True)
class IterationRecord:
    index: int  # 0-based
    started_at: float  # when the previous iteration completed (the first: the trainer's start)
    done_at: float  # when its B-th result arrived
    consumed: tuple[tuple[str, int], ...]  # (workload, sessions), sorted by workload
    session_ids: tuple[str, ...]  # in the order they were consumed

    @property
    def duration(self) -> float:
        return self.done_at - self.started_at


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """An engine's cumulative counters at the end of the measured span (vLLM's /metrics names)."""

    engine_id: str
    prefix_queries: int  # vllm:prefix_cache_queries_total, tokens looked up
    prefix_hits: int  # vllm:prefix_cache_hits_total, tokens served from cache
    preemptions: int  # vllm:num_preemptions_total


@dataclass(frozen=True, slots=True)
class KvSample:
    """An engine's KV usage from `at` until its next sample (piecewise constant), and its
    preemption counter at `at`."""

    at: float
    engine_id: str
    usage: float  # vllm:kv_cache_usage_perc, 0..1
    preemptions_total: int = 0  # vllm:num_preemptions_total


@dataclass(frozen=True, slots=True)
class PhaseMetrics:
    """One phase of a run: the cold start, or the steady state after it."""

    start: float
    end: float
    tokens_per_s: float
    sessions_per_s: float
    iterations: int  # trainer iterations that completed in the phase
    mean_iteration_s: float | None  # None when none completed
    preemptions: int
    mean_drift: float | None


@dataclass(frozen=True, slots=True)
class DriftReport:
    """Mixture drift taken apart, so that a policy's part shows apart from statistics'.

    - `startup`: mean drift of the iterations done before every workload had a first result
      (a `fifo` trainer's first batches hold only the fast workloads, whatever the policy);
    - `steady`: mean drift of the iterations of the steady state;
    - `floor`: what independent draws of exactly π give at this batch size (the expected drift
      of a multinomial batch): no admission policy can beat it on average;
    - `cumulative`: the whole run's consumed mix against π (errors that cancel out across
      iterations do not count).
    """

    startup: float | None
    steady: float | None
    floor: float
    cumulative: float


@dataclass(frozen=True, slots=True)
class WeightUpdateStats:
    """What the run's weight updates cost (`trainer.weight_update`).

    - `paused_s`: pause → resume of each update, summed (the fleet admits nothing meanwhile);
    - `drain_s`: pause → every engine paused, summed (abort: the step in flight; wait: every
      request in flight finishing; keep: 0);
    - `tokens_kept`: output tokens of stopped requests that their sessions resumed from;
    - `tokens_thrown_away`: output tokens of stopped requests that were generated again
      (`partial: false`);
    - `reprefill_tokens`: prompt tokens computed again by the requests that resumed a stopped
      turn (its prompt and the output kept, less what the prefix cache still held).
    """

    updates: int
    paused_s: float
    drain_s: float
    tokens_kept: int
    tokens_thrown_away: int
    reprefill_tokens: int


@dataclass(frozen=True, slots=True)
class ScaleStats:
    """What the scenario's fleet changes (`fleet.changes`) did.

    - `engines_joined` / `engines_left`: engines that joined, and that finished leaving (every
      session handed back or done), within the run;
    - `sessions_handed_back`: hand-backs by leaving engines, each counted (a session cut twice
      counts twice): cut mid-turn with its partial output, or moved between turns;
    - `tokens_handed_back`: output tokens of cut turns that their sessions went on from;
    - `tokens_lost_to_scale_in`: output tokens the engines generated for delivered sessions
      that a leaving engine handed back, less the tokens of their results (and less what a
      weight update with `partial: false` threw away): what was generated twice because an
      engine left. 0 when every hand-back keeps its partial output;
    - `reprefill_tokens`: prompt tokens the requests that went on from a cut turn computed again
      (the conversation so far, less what the new engine's prefix cache held).
    """

    engines_joined: int
    engines_left: int
    sessions_handed_back: int
    tokens_handed_back: int
    tokens_lost_to_scale_in: int
    reprefill_tokens: int


@dataclass(frozen=True, slots=True)
class LoraStats:
    """What LoRA adapters cost the run (`fleet.max_loras`, `workloads.*.adapters`): adapter
    loads on the engines, turns that waited for an adapter slot (every one of an engine's
    `max_loras` slots held by other adapters), and the seconds they waited, summed."""

    loads: int
    slot_waits: int
    slot_wait_s: float


@dataclass(frozen=True, slots=True)
class RunMetrics:
    span_s: float
    tokens_per_s: float
    sessions_per_s: float
    mean_iteration_s: float
    drift_per_iteration: tuple[float, ...]
    mean_drift: float
    prefix_hit_rate: float
    preemptions: int
    kv_utilisation: float
    latency_p50_s: float
    latency_p99_s: float
    cold: PhaseMetrics | None  # from the trainer's start until its first buffer turned over
    steady: PhaseMetrics | None  # the rest; None when the buffer never turned over
    steady_turnovers: float  # sessions returned in the steady state / the first fill
    drift: DriftReport
    warnings: tuple[str, ...] = ()
    weight_updates: WeightUpdateStats | None = None  # None: the scenario updates no weights
    scale: ScaleStats | None = None  # None: the scenario's fleet does not change
    lora: LoraStats | None = None  # None: LoRA is off on the scenario's engines
    # When each iteration completed, seconds after the trainer's start: the trainer's progress
    # (what `start_up_speed` compares between policies).
    iteration_done_s: tuple[float, ...] = ()


def throughput(sessions: Iterable[SessionRecord], start: float, end: float) -> tuple[float, float]:
    """(generated tokens/s, sessions/s) of sessions finished in [start, end]."""
    if end <= start:
        raise ValueError(f"span: end ({end}) must be after start ({start})")
    done = [s for s in sessions if start <= s.finished_at <= end]
    span = end - start
    return sum(s.output_tokens for s in done) / span, len(done) / span


def mean_iteration_time(iterations: Sequence[IterationRecord]) -> float:
    if not iterations:
        raise ValueError("iterations: none completed")
    return sum(it.duration for it in iterations) / len(iterations)


def prefix_hit_rate(engines: Iterable[EngineCounters]) -> float:
    """Fleet-wide hits / queries in tokens, as vLLM counts them; 0 when nothing was looked up."""
    engines = list(engines)
    queries = sum(e.prefix_queries for e in engines)
    return sum(e.prefix_hits for e in engines) / queries if queries else 0.0


def kv_utilisation(samples: Iterable[KvSample], start: float, end: float,
                   present: Mapping[str, tuple[float, float]] | None = None) -> float:
    """Time-weighted mean KV usage over [start, end], averaged over the engines sampled.

    An engine's usage is 0 before its first sample (engines start empty) and holds each sampled
    value until its next sample or `end`. `present` (a fleet that changes): engine id ->
    (joined, left); an engine counts only while it is in the fleet, so the result is the KV
    usage per engine-second present, and a fixed fleet's figure is the same with or without it.
    """
    if end <= start:
        raise ValueError(f"span: end ({end}) must be after start ({start})")
    by_engine: dict[str, list[KvSample]] = {}
    for s in samples:
        by_engine.setdefault(s.engine_id, []).append(s)
    if not by_engine:
        return 0.0
    areas, seconds = [], []
    for engine_id, series in by_engine.items():
        joined, left = present.get(engine_id, (start, end)) if present else (start, end)
        lo_e, hi_e = max(start, joined), min(end, left)
        if hi_e <= lo_e:
            continue
        series.sort(key=lambda s: s.at)
        area = 0.0
        for cur, nxt in zip(series, [*series[1:], None]):
            lo = max(cur.at, lo_e)
            hi = min(nxt.at if nxt is not None else hi_e, hi_e)
            if hi > lo:
                area += cur.usage * (hi - lo)
        areas.append(area)
        seconds.append(hi_e - lo_e)
    if present is None:  # every engine over the whole span: the mean of their means
        return sum(a / (end - start) for a in areas) / len(areas)
    return sum(areas) / sum(seconds) if seconds else 0.0


def latency_percentile(sessions: Iterable[SessionRecord], q: float) -> float:
    """q-th percentile of enqueue→result latency, linear interpolation between order statistics."""
    values = [s.latency for s in sessions]
    if not values:
        raise ValueError("sessions: none finished")
    return float(np.percentile(values, q, method="linear"))


MIN_STEADY_TURNOVERS = 3.0  # below this the steady state is too short to stand for the run


def warmup_end(sessions: Iterable[SessionRecord], first_fill: Mapping[str, int]) -> float | None:
    """When the trainer's first buffer had turned over: for every workload, as many of its
    sessions had returned as it had in the first fill (what was enqueued at the start). None
    when some workload never got there within the run."""
    finished: dict[str, list[float]] = {}
    for s in sessions:
        finished.setdefault(s.workload, []).append(s.finished_at)
    ends = []
    for w, n in first_fill.items():
        if n <= 0:
            continue
        times = sorted(finished.get(w, ()))
        if len(times) < n:
            return None
        ends.append(times[n - 1])
    return max(ends) if ends else None


def first_result_of_every_workload(sessions: Iterable[SessionRecord],
                                   target: Mapping[str, float]) -> float | None:
    """When every workload with a share had returned its first result (None: one never did)."""
    first: dict[str, float] = {}
    for s in sessions:
        first[s.workload] = min(first.get(s.workload, s.finished_at), s.finished_at)
    wanted = [w for w, p in target.items() if p > 0]
    if any(w not in first for w in wanted):
        return None
    return max((first[w] for w in wanted), default=None)


def multinomial_drift_floor(batch_size: int, target: Mapping[str, float], draws: int = 20_000,
                            seed: int = 0) -> float:
    """E[drift] of a batch of `batch_size` independent draws from exactly π (Monte Carlo with a
    fixed seed, so the same inputs give the same number)."""
    names = sorted(w for w, p in target.items() if p > 0)
    p = np.array([target[w] for w in names], dtype=float)
    p = p / p.sum()
    counts = np.random.default_rng(seed).multinomial(batch_size, p, size=draws)
    full = np.array([target.get(w, 0.0) for w in names])
    return float(0.5 * np.abs(counts / batch_size - full).sum(axis=1).mean())


def engine_preemptions(samples: Iterable[KvSample], at: float) -> int:
    """The fleet's preemption count at `at`: each engine's last sample at or before it."""
    last: dict[str, tuple[float, int]] = {}
    for s in samples:
        if s.at <= at and (s.engine_id not in last or s.at >= last[s.engine_id][0]):
            last[s.engine_id] = (s.at, s.preemptions_total)
    return sum(n for _, n in last.values())


def sync_step(next_group: Callable[[str], tuple[SimSession, ...] | None],
              quota: Mapping[str, int]) -> list[SimSession]:
    """A sync trainer's step: whole groups from `next_group` until each workload holds its
    quota of the batch (or has no more)."""
    out: list[SimSession] = []
    for w in sorted(quota):
        taken = 0
        while taken < quota[w]:
            group = next_group(w)
            if group is None:
                break
            taken += len(group)
            out.extend(group)
    return out


def start_up_speed(policy: RunMetrics, baselines: Sequence[RunMetrics]) -> float | None:
    """How fast `policy` completes the trainer's first iterations, against the quickest baseline:
    (the quickest baseline's time to its k-th iteration) / (the policy's), k being the fewest
    iterations any baseline completed in its cold start. Above 1: the policy got there sooner.

    Tokens per second over each policy's own cold start compare windows of different lengths
    (the cold start ends when that policy's first buffer has turned over); this compares the
    same k iterations. None without a baseline, or when a run completed fewer than k."""
    counts = [m.cold.iterations for m in baselines if m.cold is not None]
    if not counts:
        return None
    return iterations_speed(policy, baselines, max(1, min(counts)))


def first_tenth_speed(policy: RunMetrics, baselines: Sequence[RunMetrics],
                      iterations: int) -> float | None:
    """`iterations_speed` over the first 10% of the run's `iterations` (at least one): the
    start of a run, whatever its length, against the quickest baseline's."""
    return iterations_speed(policy, baselines, max(1, math.ceil(0.1 * iterations)))


def run_speed(policy: RunMetrics, baselines: Sequence[RunMetrics], iterations: int) -> float | None:
    """`iterations_speed` over all the run's `iterations`: how fast the trainer got through the
    whole run against the quickest baseline. Where tok/s counts every session that finished, this
    counts only what the trainer took: a `quota` trainer holds the surplus of its quick workloads
    unconsumed while it waits for its slowest one."""
    return iterations_speed(policy, baselines, iterations)


def iterations_speed(policy: RunMetrics, baselines: Sequence[RunMetrics], k: int) -> float | None:
    """(The quickest baseline's time to its k-th iteration) / (the policy's); None without a
    baseline that got there, or when the policy did not."""
    times = [m.iteration_done_s[k - 1] for m in baselines if len(m.iteration_done_s) >= k]
    if not times or len(policy.iteration_done_s) < k:
        return None
    return min(times) / policy.iteration_done_s[k - 1]


def phase_metrics(sessions: Sequence[SessionRecord], iterations: Sequence[IterationRecord],
                  samples: Sequence[KvSample], target: Mapping[str, float],
                  start: float, end: float, first: bool) -> PhaseMetrics:
    """The metrics of (start, end], or of [start, end] for the `first` phase of a run."""
    if end <= start:
        raise ValueError(f"span: end ({end}) must be after start ({start})")
    done = [s for s in sessions
            if (start < s.finished_at or (first and s.finished_at == start)) and s.finished_at <= end]
    span = end - start
    tokens_s, sessions_s = sum(s.output_tokens for s in done) / span, len(done) / span
    mine = [it for it in iterations if start < it.done_at <= end]
    drift = [mixture_drift(dict(it.consumed), target) for it in mine]
    return PhaseMetrics(
        start=start, end=end, tokens_per_s=tokens_s, sessions_per_s=sessions_s,
        iterations=len(mine),
        mean_iteration_s=mean_iteration_time(mine) if mine else None,
        preemptions=engine_preemptions(samples, end) - engine_preemptions(samples, start),
        mean_drift=sum(drift) / len(drift) if drift else None,
    )


def summarize(
    sessions: Sequence[SessionRecord],
    iterations: Sequence[IterationRecord],
    engines: Sequence[EngineCounters],
    kv_samples: Sequence[KvSample],
    target: Mapping[str, float],
    start: float,
    end: float,
    batch_size: int | None = None,
    first_fill: Mapping[str, int] | None = None,
    present: Mapping[str, tuple[float, float]] | None = None,
) -> RunMetrics:
    """Every §6 metric over the measured span [start, end] (normally trainer start → last
    iteration), and the same split into the cold start and the steady state, with the drift
    taken apart (`DriftReport`) and warnings when the run is too short to say much.

    `first_fill`: sessions per workload the trainer enqueued at `start`, returned or not
    (default: those among `sessions` enqueued by then). `present`: when each engine joined and
    left, for a fleet that changes (`kv_utilisation`)."""
    tokens_s, sessions_s = throughput(sessions, start, end)
    drift = tuple(mixture_drift(dict(it.consumed), target) for it in iterations)
    measured = [s for s in sessions if start <= s.finished_at <= end]
    warnings: list[str] = []
    if first_fill is None:
        first_fill = {}
        for s in sessions:
            if s.enqueued_at <= start:
                first_fill[s.workload] = first_fill.get(s.workload, 0) + 1
    warm = warmup_end(sessions, first_fill)
    cold = steady = None
    turnovers = 0.0
    if warm is not None and warm <= start:
        warm = None
    if warm is None or warm >= end:
        warnings.append("no steady state: the trainer's first buffer never turned over "
                        "within the run; every figure is start-up")
        cold = phase_metrics(sessions, iterations, kv_samples, target, start, end, first=True)
    else:
        cold = phase_metrics(sessions, iterations, kv_samples, target, start, warm, first=True)
        steady = phase_metrics(sessions, iterations, kv_samples, target, warm, end, first=False)
        filled = sum(first_fill.values())
        returned = sum(1 for s in sessions if warm < s.finished_at <= end)
        turnovers = returned / filled if filled else 0.0
        if turnovers < MIN_STEADY_TURNOVERS:
            warnings.append(f"short steady state: {turnovers:.1f} buffer turnovers after the "
                            f"start-up (want ≥ {MIN_STEADY_TURNOVERS:g}); run more iterations")
    every_first = first_result_of_every_workload(sessions, target)
    startup = [d for it, d in zip(iterations, drift)
               if every_first is None or it.done_at < every_first]
    consumed_total: dict[str, int] = {}
    for it in iterations:
        for w, n in it.consumed:
            consumed_total[w] = consumed_total.get(w, 0) + n
    b = batch_size or (sum(n for _, n in iterations[0].consumed) if iterations else 1)
    report = DriftReport(
        startup=sum(startup) / len(startup) if startup else None,
        steady=steady.mean_drift if steady is not None else None,
        floor=multinomial_drift_floor(b, target),
        cumulative=mixture_drift(consumed_total, target) if consumed_total else 0.0,
    )
    return RunMetrics(
        span_s=end - start,
        tokens_per_s=tokens_s,
        sessions_per_s=sessions_s,
        mean_iteration_s=mean_iteration_time(iterations),
        drift_per_iteration=drift,
        mean_drift=sum(drift) / len(drift),
        prefix_hit_rate=prefix_hit_rate(engines),
        preemptions=sum(e.preemptions for e in engines),
        kv_utilisation=kv_utilisation(kv_samples, start, end, present),
        latency_p50_s=latency_percentile(measured, 50),
        latency_p99_s=latency_percentile(measured, 99),
        cold=cold,
        steady=steady,
        steady_turnovers=turnovers,
        drift=report,
        warnings=tuple(warnings),
        iteration_done_s=tuple(it.done_at - start for it in iterations),
    )


class Trainer:
    """The RL trainer as a state machine the fleet simulator drives (docs/measurement.md).

    Arrivals. `buffer`: closed loop; `enqueue(now)` returns whole groups while the sessions
    enqueued and not yet returned stay ≤ `inflight_bound`, choosing the workload whose enqueued
    count would stay lowest relative to π_w (ties by name), and keeps the buffer full until the
    last iteration completes, as an asynchronous trainer's rollout loop does (what is still in
    flight then is dropped). Stopping at exactly iterations·B instead would end every run with
    a drain of the longest sessions alone, a mixture artifact of the model, not of a policy.
    `recorded`: open loop; `enqueue(now)` returns every trace session with arrival_at ≤ now and
    `next_arrival_at()` says when the next one is due.

    Consumption. `fifo`: each iteration is the next B results in completion order. `quota`: an
    iteration completes when quota_w results of every workload are held; extras wait for the
    next one. `on_result` returns the iterations a result completed (0 or 1).

    Loops, as RL frameworks run them:
    - `async` (above): the rollout buffer is refilled as results come back; with
      `max_staleness` k the producer is also held to at most k iterations ahead of the
      trainer: no more than (iterations done + 1 + k)·B sessions are ever enqueued (AReaL's
      `max_head_offpolicyness`, verl's fully-async `staleness_threshold`);
    - `sync` (verl's default): each step enqueues whole groups until it holds B sessions in the
      mixture's quotas, waits for every one of them (the iteration is the whole step), trains
      for `train_s`, then enqueues the next step. `mode` and `inflight_bound` do not apply.
    """

    def __init__(
        self,
        source: SessionSource,
        *,
        mode: Literal["fifo", "quota"],
        batch_size: int,
        mixture: Mapping[str, float],
        inflight_bound: int,
        iterations: int,
        arrival: Literal["buffer", "recorded"] = "buffer",
        start: float = 0.0,
        loop: Literal["async", "sync"] = "async",
        max_staleness: int | None = None,
        train_s: float = 0.0,
    ) -> None:
        if batch_size < 1 or inflight_bound < 1 or iterations < 1:
            raise ValueError("batch_size, inflight_bound and iterations must be ≥ 1")
        if loop == "sync" and arrival != "buffer":
            raise ValueError("loop: 'sync' generates its own steps; it cannot replay arrivals")
        if max_staleness is not None and (loop != "async" or max_staleness < 0):
            raise ValueError("max_staleness: an async loop's bound, ≥ 0")
        self.mode = mode
        self.batch_size = batch_size
        self.mixture = dict(mixture)
        self.inflight_bound = inflight_bound
        self.target_iterations = iterations
        self.arrival = arrival
        self.loop = loop
        self.max_staleness = max_staleness
        self.train_s = train_s
        self._step: set[str] = set()  # sync: the ids of the step in flight
        self._step_results: list[SessionRecord] = []
        self._next_step_at: float | None = start  # sync: when the next step may be enqueued
        self.quota = quotas(batch_size, self.mixture)
        self.iterations: list[IterationRecord] = []
        self.consumed: dict[str, int] = {w: 0 for w in self.mixture}  # cumulative, for Snapshot
        self.enqueued: dict[str, int] = {w: 0 for w in self.mixture}
        self.returned = 0
        self._source = source
        self._peeked: dict[str, tuple[SimSession, ...] | None] = {}
        self._recorded = deque(source.recorded()) if arrival == "recorded" else deque()
        self._fifo: deque[SessionRecord] = deque()
        self._held: dict[str, deque[SessionRecord]] = {w: deque() for w in self.mixture}
        self._last_done = start

    @classmethod
    def from_scenario(cls, scenario: Scenario, source: SessionSource, start: float = 0.0) -> Trainer:
        t = scenario.trainer
        return cls(
            source,
            mode=t.mode,
            batch_size=t.batch_size,
            mixture=scenario.mixture,
            inflight_bound=t.inflight_bound,
            iterations=t.iterations,
            arrival=t.arrival,
            start=start,
            loop=t.loop,
            max_staleness=t.max_staleness,
            train_s=t.train_s,
        )

    @property
    def outstanding(self) -> int:
        """Sessions enqueued whose result has not come back."""
        return sum(self.enqueued.values()) - self.returned

    @property
    def done(self) -> bool:
        return len(self.iterations) >= self.target_iterations

    def stalled(self) -> bool:
        """Not done, yet nothing is outstanding and nothing more will ever be enqueued."""
        if self.done or self.outstanding:
            return False
        if self.arrival == "recorded":
            return not self._recorded
        if self.loop == "sync" and self._next_step_at is not None:
            return all(self._peek(w) is None for w in self.quota)
        return self._pick() is None

    def next_arrival_at(self) -> float | None:
        """When the trainer next enqueues on its own: a recorded arrival, or a sync step after
        its training time (None when nothing is due)."""
        if self.loop == "sync":
            return self._next_step_at if not self.done and not self._step else None
        return self._recorded[0].arrival_at if self._recorded else None

    def enqueue(self, now: float) -> list[SimSession]:
        """Sessions the trainer enqueues at `now`; whole groups, in a deterministic order."""
        out: list[SimSession] = []
        if self.arrival == "recorded":
            while self._recorded and self._recorded[0].arrival_at <= now:
                out.append(self._take_recorded())
            return out
        if self.loop == "sync":
            return self._enqueue_step(now)
        while not self.done:
            w = self._pick()
            if w is None:
                break
            group = self._peeked.pop(w)
            assert group is not None
            ahead = (self.max_staleness is not None and sum(self.enqueued.values()) + len(group)
                     > (len(self.iterations) + 1 + self.max_staleness) * self.batch_size)
            if self.outstanding + len(group) > self.inflight_bound or ahead:
                self._peeked[w] = group  # keep order: this group goes first when room frees
                break
            self.enqueued[w] += len(group)
            out.extend(group)
        return out

    def _enqueue_step(self, now: float) -> list[SimSession]:
        """A sync step: whole groups until each workload holds its quota of B."""
        if self.done or self._step or self._next_step_at is None or now < self._next_step_at:
            return []
        out = sync_step(self._take, self.quota)
        self._step = {s.session_id for s in out}
        self._next_step_at = None
        return out

    def _take(self, w: str) -> tuple[SimSession, ...] | None:
        """Enqueue the next group of `w` (None when it has no more)."""
        group = self._peek(w)
        if group is not None:
            self._peeked.pop(w)
            self.enqueued[w] += len(group)
        return group

    def _take_recorded(self) -> SimSession:
        s = self._recorded.popleft()
        self.enqueued[s.workload] = self.enqueued.get(s.workload, 0) + 1
        return s

    def _peek(self, w: str) -> tuple[SimSession, ...] | None:
        if w not in self._peeked:
            self._peeked[w] = self._source.next_group(w)
        return self._peeked[w]

    def _pick(self) -> str | None:
        best: tuple[float, str] | None = None
        for w, share in self.mixture.items():
            if share <= 0:
                continue
            group = self._peek(w)
            if group is None:
                continue
            key = ((self.enqueued[w] + len(group)) / share, w)
            if best is None or key < best:
                best = key
        return best[1] if best else None

    def on_result(self, record: SessionRecord, now: float) -> list[IterationRecord]:
        """Take one finished session; returns the iteration it completed, if any."""
        self.returned += 1
        if self.done:
            return []
        if self.loop == "sync":
            self._step.discard(record.session_id)
            self._step_results.append(record)
            if self._step:
                return []
            batch, self._step_results = self._step_results, []
            self._next_step_at = now + self.train_s
            return [self._complete(batch, now)]
        if self.mode == "fifo":
            self._fifo.append(record)
            if len(self._fifo) < self.batch_size:
                return []
            batch = [self._fifo.popleft() for _ in range(self.batch_size)]
        else:
            if record.workload not in self._held or self.quota[record.workload] == 0:
                return []
            self._held[record.workload].append(record)
            if any(len(self._held[w]) < q for w, q in self.quota.items()):
                return []
            batch = [self._held[w].popleft() for w in sorted(self.quota) for _ in range(self.quota[w])]
        return [self._complete(batch, now)]

    def _complete(self, batch: list[SessionRecord], now: float) -> IterationRecord:
        counts: dict[str, int] = {}
        for r in batch:
            counts[r.workload] = counts.get(r.workload, 0) + 1
            self.consumed[r.workload] = self.consumed.get(r.workload, 0) + 1
        it = IterationRecord(
            index=len(self.iterations),
            started_at=self._last_done,
            done_at=now,
            consumed=tuple(sorted(counts.items())),
            session_ids=tuple(r.session_id for r in batch),
        )
        self.iterations.append(it)
        self._last_done = now
        return it
