"""What a valid scenario still cannot give: constraints its sessions do not meet, said aloud.

`scenario_warnings` samples the scenario's own sessions and compares them with what the file
asks for. A warning is not an error (the scenario runs as generated), but a result measured on
sessions other than the ones described must not pass unnoticed:
- an agentic episode ends before a turn whose prompt + max_tokens passes
  `max_context_tokens`, so a long `turns` distribution may be cut well short;
- a workload whose outputs hit `max_tokens` often is measuring the cap, not the distribution;
- an agent-driven workload none of whose gaps between calls outlasts `idle_timeout_s` never
  parks an episode: it runs as a worker-driven one that hides `waiting_on_tool`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sim.bound import sample_sessions
from sim.scenario import AgenticSpec, Scenario

CUT_TOLERANCE = 0.9  # warn when episodes get < 90 % of the turns asked for, on average
TRUNCATION_WARN = 0.2  # warn when over 20 % of a workload's turns stop at max_tokens


def requested_mean_turns(spec: AgenticSpec, draws: int = 20_000, seed: int = 0) -> float:
    """The mean of the turns distribution as the file asks for it, before the context cap."""
    rng = np.random.default_rng(seed)
    raw = spec.turns.median * np.exp(spec.turns.sigma * rng.standard_normal(draws))
    if spec.turns.cap is not None:
        raw = np.minimum(raw, spec.turns.cap)
    return float(np.clip(np.rint(raw), spec.min_turns, spec.max_turns).mean())


def scenario_warnings(scenario: Scenario, scenario_path: str | Path,
                      samples: int = 2_000) -> list[str]:
    if scenario.source != "generators":
        return []
    sessions = sample_sessions(scenario, scenario_path, samples)
    out: list[str] = []
    for name, spec in scenario.workloads.items():
        mine = [s for s in sessions if s.workload == name]
        if not mine:
            continue
        if isinstance(spec, AgenticSpec):
            asked = requested_mean_turns(spec)
            got = float(np.mean([s.truth.turns for s in mine]))
            if got < CUT_TOLERANCE * asked:
                out.append(f"workloads.{name}.turns: episodes get {got:.1f} turns on average, "
                           f"not the {asked:.1f} asked for: max_context_tokens "
                           f"({spec.max_context_tokens:,}) ends them first")
            timeout = spec.parking_timeout_s
            gaps = [g for s in mine for g in s.truth.tool_latency_s]
            if timeout is not None and gaps and max(gaps) <= timeout:
                out.append(f"workloads.{name}.idle_timeout_s: no gap between calls outlasts it "
                           f"({timeout:g} s; the longest of {len(gaps):,} sampled is "
                           f"{max(gaps):.1f} s), so no episode is ever parked")
        turns = [t for s in mine for t in s.truth.truncated]
        share = sum(turns) / len(turns)
        if share > TRUNCATION_WARN:
            out.append(f"workloads.{name}.max_tokens: {share:.0%} of turns stop at the cap "
                       f"({spec.max_tokens:,} tokens), so lengths are mostly the cap's")
    return out
