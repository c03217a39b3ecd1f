"""Where the trainer gets its next group of sessions: the generators or a recorded trace."""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Protocol

from sim.scenario import Scenario, resolve_trace_path
from sim.trace import read_trace
from sim.workloads.generators import generate_group
from sim.workloads.truth import SimSession


class SessionSource(Protocol):
    def next_group(self, workload: str) -> tuple[SimSession, ...] | None:
        """The next group of `workload` (members enqueued together), or None when exhausted."""

    def recorded(self) -> tuple[SimSession, ...]:
        """Every session with a recorded arrival time, in arrival order (empty for generators)."""


class GeneratedSource:
    """Unbounded: group i of workload w is `generate_group(scenario, w, i)`."""

    def __init__(self, scenario: Scenario) -> None:
        self._scenario = scenario
        self._next_index = {w: 0 for w in scenario.workloads}

    def next_group(self, workload: str) -> tuple[SimSession, ...] | None:
        if workload not in self._next_index:
            return None
        index = self._next_index[workload]
        self._next_index[workload] = index + 1
        return generate_group(self._scenario, workload, index)

    def recorded(self) -> tuple[SimSession, ...]:
        return ()


class TraceSource:
    """Finite: a trace's sessions, grouped by consecutive equal `group_id` in file order."""

    def __init__(self, sessions: list[SimSession]) -> None:
        self._sessions = tuple(sessions)
        self._groups: dict[str, deque[tuple[SimSession, ...]]] = {}
        current: list[SimSession] = []
        for s in sessions:
            if current and (s.session.group_id is None or s.session.group_id != current[-1].session.group_id
                            or s.workload != current[-1].workload):
                self._push(current)
                current = []
            current.append(s)
        if current:
            self._push(current)

    def _push(self, group: list[SimSession]) -> None:
        self._groups.setdefault(group[0].workload, deque()).append(tuple(group))

    def next_group(self, workload: str) -> tuple[SimSession, ...] | None:
        queue = self._groups.get(workload)
        return queue.popleft() if queue else None

    def recorded(self) -> tuple[SimSession, ...]:
        missing = [s.session_id for s in self._sessions if s.arrival_at is None]
        if missing:
            raise ValueError(f"arrival: 'recorded' needs arrival_at on every session ({missing[0]} has none)")
        return tuple(sorted(self._sessions, key=lambda s: s.arrival_at))  # stable: file order on ties


def make_source(scenario: Scenario, scenario_path: str | Path) -> GeneratedSource | TraceSource:
    if scenario.source == "trace":
        return TraceSource(read_trace(resolve_trace_path(scenario, scenario_path)))
    return GeneratedSource(scenario)
