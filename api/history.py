"""Recent samples of monotonic counters, so windows (last minute, last 5 min) come without
scanning streams: each status read appends the counters it already fetched, and a window's rate
is the difference to the oldest sample inside it. Process-local: a fresh API process reports
the span it has seen (`covered_s`), growing to the full window."""

from __future__ import annotations

import bisect
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

MIN_SPACING_S = 0.25  # denser samples add nothing to a minute-long window


@dataclass(frozen=True, slots=True)
class Sample:
    at: float
    finished: Mapping[str, int]  # workload -> results published, ever
    consumed: Mapping[str, int]  # workload -> results acknowledged, ever
    tokens: Mapping[str, int] = field(default_factory=dict)  # workload -> output tokens, ever
    latency: Mapping[str, int] = field(default_factory=dict)  # "<workload>:<bucket>" -> results


@dataclass(frozen=True, slots=True)
class Delta:
    span_s: float
    finished: dict[str, int]
    consumed: dict[str, int]
    tokens: dict[str, int]
    latency: dict[str, int]


def _diff(new: Mapping[str, int], old: Mapping[str, int]) -> dict[str, int]:
    # A counter lower than before means the namespace was reset: count from zero again.
    return {w: (v - old.get(w, 0)) if v >= old.get(w, 0) else v for w, v in new.items()}


class CounterHistory:
    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self._samples: deque[Sample] = deque()
        self._lock = threading.Lock()

    def add(self, sample: Sample) -> None:
        with self._lock:
            if self._samples and sample.at - self._samples[-1].at < MIN_SPACING_S:
                return
            self._samples.append(sample)
            while self._samples and sample.at - self._samples[0].at > self.keep_s:
                self._samples.popleft()

    def delta(self, now: Sample, window_s: float) -> Delta:
        """Counts added over the last `window_s` (or the shorter span sampled so far)."""
        with self._lock:
            times = [s.at for s in self._samples]
            i = bisect.bisect_left(times, now.at - window_s)
            old = self._samples[i] if i < len(self._samples) else now
        return Delta(span_s=max(0.0, now.at - old.at), finished=_diff(now.finished, old.finished),
                     consumed=_diff(now.consumed, old.consumed),
                     tokens=_diff(now.tokens, old.tokens),
                     latency=_diff(now.latency, old.latency))


@dataclass(frozen=True, slots=True)
class ChartSample:
    """What the dashboard's charts plot, at one status read."""

    at: float
    queue: dict[str, int]  # workload -> sessions waiting
    kv: dict[str, float]  # backend -> the engine's KV usage, 0..1
    drift: dict[str, float]  # "recent", "total"


class ChartTrail:
    """The charts' last `keep_s` seconds, kept by the API process (a background sampler and
    every status read add to it), so a dashboard opened now starts with history."""

    def __init__(self, keep_s: float, min_spacing_s: float = 1.0) -> None:
        self.keep_s = keep_s
        self.min_spacing_s = min_spacing_s
        self._samples: deque[ChartSample] = deque()
        self._lock = threading.Lock()

    def add(self, sample: ChartSample) -> None:
        with self._lock:
            if self._samples and sample.at - self._samples[-1].at < self.min_spacing_s:
                return
            self._samples.append(sample)
            while self._samples and sample.at - self._samples[0].at > self.keep_s:
                self._samples.popleft()

    def samples(self) -> list[ChartSample]:
        with self._lock:
            return list(self._samples)
