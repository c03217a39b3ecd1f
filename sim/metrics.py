"""Run metrics as DESIGN §6 defines them, and the trainer that consumes results.

Pure functions on plain records: the fleet simulator fills `SessionRecord`, `EngineCounters` and
`KvSample`; the `Trainer` turns finished sessions into `IterationRecord`s. Nothing here knows
about engines or the event loop, so each definition is tested on numbers worked out by hand.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
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
    """Engine KV usage from `at` until the engine's next sample (piecewise constant)."""

    at: float
    engine_id: str
    usage: float  # vllm:kv_cache_usage_perc, 0..1


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


def kv_utilisation(samples: Iterable[KvSample], start: float, end: float) -> float:
    """Time-weighted mean KV usage over [start, end], averaged over the engines sampled.

    An engine's usage is 0 before its first sample (engines start empty) and holds each sampled
    value until its next sample or `end`.
    """
    if end <= start:
        raise ValueError(f"span: end ({end}) must be after start ({start})")
    by_engine: dict[str, list[KvSample]] = {}
    for s in samples:
        by_engine.setdefault(s.engine_id, []).append(s)
    if not by_engine:
        return 0.0
    means = []
    for series in by_engine.values():
        series.sort(key=lambda s: s.at)
        area = 0.0
        for cur, nxt in zip(series, [*series[1:], None]):
            lo = max(cur.at, start)
            hi = min(nxt.at if nxt is not None else end, end)
            if hi > lo:
                area += cur.usage * (hi - lo)
        means.append(area / (end - start))
    return sum(means) / len(means)


def latency_percentile(sessions: Iterable[SessionRecord], q: float) -> float:
    """q-th percentile of enqueue→result latency, linear interpolation between order statistics."""
    values = [s.latency for s in sessions]
    if not values:
        raise ValueError("sessions: none finished")
    return float(np.percentile(values, q, method="linear"))


def summarize(
    sessions: Sequence[SessionRecord],
    iterations: Sequence[IterationRecord],
    engines: Sequence[EngineCounters],
    kv_samples: Sequence[KvSample],
    target: Mapping[str, float],
    start: float,
    end: float,
) -> RunMetrics:
    """Every §6 metric over the measured span [start, end] (normally trainer start → last iteration)."""
    tokens_s, sessions_s = throughput(sessions, start, end)
    drift = tuple(mixture_drift(dict(it.consumed), target) for it in iterations)
    measured = [s for s in sessions if start <= s.finished_at <= end]
    return RunMetrics(
        span_s=end - start,
        tokens_per_s=tokens_s,
        sessions_per_s=sessions_s,
        mean_iteration_s=mean_iteration_time(iterations),
        drift_per_iteration=drift,
        mean_drift=sum(drift) / len(drift),
        prefix_hit_rate=prefix_hit_rate(engines),
        preemptions=sum(e.preemptions for e in engines),
        kv_utilisation=kv_utilisation(kv_samples, start, end),
        latency_p50_s=latency_percentile(measured, 50),
        latency_p99_s=latency_percentile(measured, 99),
    )


class Trainer:
    """The RL trainer as a state machine the fleet simulator drives (DESIGN §6).

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
    ) -> None:
        if batch_size < 1 or inflight_bound < 1 or iterations < 1:
            raise ValueError("batch_size, inflight_bound and iterations must be ≥ 1")
        self.mode = mode
        self.batch_size = batch_size
        self.mixture = dict(mixture)
        self.inflight_bound = inflight_bound
        self.target_iterations = iterations
        self.arrival = arrival
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
        return self._pick() is None

    def next_arrival_at(self) -> float | None:
        """When a recorded arrival is next due (None in buffer mode or when none are left)."""
        return self._recorded[0].arrival_at if self._recorded else None

    def enqueue(self, now: float) -> list[SimSession]:
        """Sessions the trainer enqueues at `now`; whole groups, in a deterministic order."""
        out: list[SimSession] = []
        if self.arrival == "recorded":
            while self._recorded and self._recorded[0].arrival_at <= now:
                out.append(self._take_recorded())
            return out
        while not self.done:
            w = self._pick()
            if w is None:
                break
            group = self._peeked.pop(w)
            assert group is not None
            if self.outstanding + len(group) > self.inflight_bound:
                self._peeked[w] = group  # keep order: this group goes first when room frees
                break
            self.enqueued[w] += len(group)
            out.extend(group)
        return out

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
