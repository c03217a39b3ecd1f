"""A family of scenarios: ranges to draw from, so results are not claims about one scenario.

`scenarios/family.yaml` (a `FamilySpec`) names a base scenario and ranges for what varies:
engines, engine profile, KV tokens per engine, the workload mixture (any share of rlvr, rlhf,
agentic, a workload possibly absent), group sizes, how slow tools are, how many turns an
episode asks for, the trainer loop, and the in-flight bound from under- to over-subscribed
(sessions in flight per engine). `sample_family(spec, n, seed)` draws n scenarios, each a
plain `Scenario` with its own seed; the same (spec, n, seed) give the same scenarios.

Each scenario runs long enough for its steady state to hold `turnovers` buffer turnovers (the
first buffer turns over within the first `inflight/B` iterations; the rest is steady state), so
no result measures start-up alone.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sim.scenario import (
    WORKLOAD_KINDS,
    Scenario,
    ScenarioError,
    load_scenario,
    parse_scenario,
)

_STRICT = ConfigDict(extra="forbid", frozen=True)

Loop = Literal["sync", "async-fifo", "async-quota", "async-stale"]


def _range(lo_hi: tuple[float, float], name: str) -> tuple[float, float]:
    lo, hi = lo_hi
    if not 0 < lo <= hi:
        raise ValueError(f"{name}: need 0 < low ≤ high, got [{lo}, {hi}]")
    return lo_hi


class FamilySpec(BaseModel):
    model_config = _STRICT

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    base: str  # scenario file (relative to this file) whose other fields every sample keeps
    engines: tuple[int, int] = (2, 32)  # log-uniform
    profiles: Annotated[list[str], Field(min_length=1)]
    kv_tokens: tuple[int, int] | None = None  # per engine, log-uniform; None: the profile's
    # Each workload's weight is uniform in [0, 1] and present with `workload_presence`
    # probability; the shares are the weights normalised (at least one workload present).
    workloads: Annotated[list[Literal["rlvr", "rlhf", "agentic"]], Field(min_length=1)] = list(
        WORKLOAD_KINDS)
    workload_presence: Annotated[float, Field(gt=0, le=1)] = 0.8
    group_size: dict[str, tuple[int, int]] = Field(default_factory=dict)  # log-uniform
    tool_latency_scale: tuple[float, float] = (0.25, 4.0)  # multiplies agentic tool latencies
    turns_median: tuple[float, float] = (2.0, 20.0)  # agentic episodes' median turns asked for
    loops: Annotated[list[Loop], Field(min_length=1)] = ["sync", "async-fifo", "async-quota",
                                                         "async-stale"]
    inflight_per_engine: tuple[int, int] = (8, 256)  # log-uniform: under- to over-subscribed
    batch_size: tuple[int, int] = (32, 256)  # log-uniform
    max_staleness: int = 1  # for async-stale
    turnovers: Annotated[float, Field(gt=0)] = 4.0  # steady-state buffer turnovers per run
    sync_steps: Annotated[int, Field(ge=2)] = 8  # iterations of a sync scenario
    max_wall_s: Annotated[float, Field(gt=0)] = 1800.0  # per run: a safety stop, not a budget

    @model_validator(mode="after")
    def _ranges(self) -> FamilySpec:
        _range(self.engines, "engines")
        _range(self.tool_latency_scale, "tool_latency_scale")
        _range(self.turns_median, "turns_median")
        _range(self.inflight_per_engine, "inflight_per_engine")
        _range(self.batch_size, "batch_size")
        if self.kv_tokens is not None:
            _range(self.kv_tokens, "kv_tokens")
        for w, r in self.group_size.items():
            if w not in self.workloads:
                raise ValueError(f"group_size.{w}: not one of the family's workloads")
            _range(r, f"group_size.{w}")
        return self


def load_family(path: str | Path) -> FamilySpec:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ScenarioError(f"{path.name}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{path.name}: YAML syntax error: {exc}") from None
    try:
        return FamilySpec.model_validate(data)
    except ValidationError as exc:
        lines = []
        for e in exc.errors():
            where = ".".join(map(str, e["loc"]))
            msg = str(e["msg"]).removeprefix("Value error, ")
            lines.append(f"{path.name}: {where}: {msg}" if where else f"{path.name}: {msg}")
        raise ScenarioError("\n".join(lines)) from None


def _log_uniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def _log_int(rng: np.random.Generator, lo_hi: tuple[int, int]) -> int:
    lo, hi = lo_hi
    return int(min(hi, max(lo, round(_log_uniform(rng, lo, hi + 0.999)))))


def sample_scenario(spec: FamilySpec, base: Scenario, index: int, seed: int) -> Scenario:
    """Scenario `index` of the family drawn with `seed`."""
    rng = np.random.default_rng([seed, index])
    data = base.model_dump(mode="python")
    engines = _log_int(rng, spec.engines)
    fleet = {"engines": engines, "profile": str(rng.choice(spec.profiles))}
    if spec.kv_tokens is not None:
        fleet["kv_tokens"] = _log_int(rng, spec.kv_tokens)
    data["fleet"] = fleet
    present = [w for w in spec.workloads if rng.uniform() < spec.workload_presence]
    if not present:
        present = [str(rng.choice(spec.workloads))]
    weights = {w: float(rng.uniform(0.05, 1.0)) for w in present}
    total = sum(weights.values())
    mixture = {w: v / total for w, v in weights.items()}
    mixture[present[-1]] = 1.0 - sum(v for w, v in mixture.items() if w != present[-1])
    data["mixture"] = mixture
    workloads = {}
    for w in present:
        spec_w = dict(data["workloads"][w])
        if w in spec.group_size:
            spec_w["group_size"] = _log_int(rng, spec.group_size[w])
        if w == "agentic":
            median = _log_uniform(rng, *spec.turns_median)
            spec_w["turns"] = {**spec_w["turns"], "median": median}
            spec_w["max_turns"] = max(spec_w["max_turns"], math.ceil(3 * median))
            spec_w["min_turns"] = min(spec_w["min_turns"], spec_w["max_turns"])
            scale = _log_uniform(rng, *spec.tool_latency_scale)
            spec_w["tool_latency"] = {
                **spec_w["tool_latency"],
                "components": [{**c, "median": c["median"] * scale}
                               for c in spec_w["tool_latency"]["components"]]}
        workloads[w] = spec_w
    data["workloads"] = workloads
    biggest = max(w["group_size"] for w in workloads.values())
    loop = str(rng.choice(spec.loops))
    batch = max(_log_int(rng, spec.batch_size), biggest)
    inflight = max(engines * _log_int(rng, spec.inflight_per_engine), biggest, batch)
    trainer = {"batch_size": batch, "inflight_bound": inflight}
    if loop == "sync":
        trainer.update(loop="sync", iterations=spec.sync_steps)
    else:
        trainer.update(loop="async", mode="quota" if loop == "async-quota" else "fifo",
                       iterations=math.ceil((spec.turnovers + 1) * inflight / batch))
        if loop == "async-stale":
            trainer["max_staleness"] = spec.max_staleness
    data["trainer"] = {**{k: v for k, v in data["trainer"].items()
                          if k in ("arrival",)}, **trainer}
    data["limits"] = {**data["limits"], "max_wall_s": spec.max_wall_s}
    data["name"] = f"{spec.name}-{index:03d}"
    data["seed"] = seed * 1000 + index
    return parse_scenario(data, origin=data["name"])


def sample_family(spec: FamilySpec, spec_path: str | Path, n: int, seed: int) -> list[Scenario]:
    base = load_scenario(Path(spec_path).parent / spec.base)
    return [sample_scenario(spec, base, i, seed) for i in range(n)]


def describe(s: Scenario) -> str:
    """One line: what varies in a family member."""
    mix = "/".join(f"{w} {p:.2f}" for w, p in s.mixture.items())
    groups = ",".join(f"{w}×{spec.group_size}" for w, spec in s.workloads.items())
    t = s.trainer
    loop = t.loop if t.loop == "sync" else f"async-{t.mode}" + (
        f"-stale{t.max_staleness}" if t.max_staleness is not None else "")
    kv = f", {s.fleet.kv_tokens:,} KV" if s.fleet.kv_tokens else ""
    return (f"{s.fleet.engines}×{s.fleet.profile}{kv}; {mix}; groups {groups}; {loop}, "
            f"B {t.batch_size}, {t.inflight_bound} in flight, {t.iterations} iterations")
