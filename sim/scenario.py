"""Scenario files: the fleet, the workloads and their distributions, the trainer, the seed.

A scenario is YAML validated by the pydantic models below (`extra="forbid"` everywhere, so a
misspelt key is an error, not a silent default). `load_scenario(path)` raises `ScenarioError`
whose message names the file, the field path and the reason, one line per problem, e.g.
`quick.yaml: workloads.rlvr.group_size: must be ≥ 1`.

Defaults are the "Fit" distributions of shared/WORKLOADS.md; each cites its source key.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

_STRICT = ConfigDict(extra="forbid", frozen=True)

PosInt = Annotated[int, Field(ge=1)]
PosFloat = Annotated[float, Field(gt=0.0)]
NonNegFloat = Annotated[float, Field(ge=0.0)]


class ScenarioError(ValueError):
    """A scenario file that cannot be used; the message names the file, field and reason."""


class LogNormal(BaseModel):
    """LN(median, sigma): exp(N(ln median, sigma²)); samples above `cap` are set to `cap`."""

    model_config = _STRICT

    median: PosFloat
    sigma: NonNegFloat
    cap: PosFloat | None = None


class MixtureComponent(BaseModel):
    model_config = _STRICT

    weight: PosFloat
    median: PosFloat
    sigma: NonNegFloat


class LogNormalMixture(BaseModel):
    """A weighted mixture of lognormals (weights are normalised), capped at `cap`."""

    model_config = _STRICT

    components: Annotated[list[MixtureComponent], Field(min_length=1)]
    cap: PosFloat | None = None


# Tool call latency, seconds: 70% LN(0.15 s, 1.0) + 30% LN(2 s, 1.5), cap 120 s ([TL3], [X1], [X3]).
DEFAULT_TOOL_LATENCY = LogNormalMixture(
    components=[
        MixtureComponent(weight=0.7, median=0.15, sigma=1.0),
        MixtureComponent(weight=0.3, median=2.0, sigma=1.5),
    ],
    cap=120.0,
)


# The live gateway's idle timeout (its `idle_timeout_s` default): an agent-driven episode with
# no call for this long gives its KV reservation back.
DEFAULT_IDLE_TIMEOUT_S = 30.0


class _WorkloadBase(BaseModel):
    model_config = _STRICT

    group_size: PosInt
    max_tokens: PosInt  # per-turn output cap: the engine stops a turn here (truncation)
    temperature: Annotated[float, Field(ge=0.0, le=10.0)] = 1.0
    # Reward / verifier time after the last turn, seconds; None = instantaneous.
    final_latency: LogNormal | None = None
    # LoRA: the workload's sessions use this many adapters (`<workload>-a<k>`), one per GRPO
    # group drawn uniformly (jobs or policies sharing the fleet); 0: the base model.
    adapters: Annotated[int, Field(ge=0, le=10_000)] = 0

    @model_validator(mode="before")
    @classmethod
    def _driver_is_multi_turn(cls, data: Any) -> Any:
        if isinstance(data, dict) and "driver" not in cls.model_fields:
            for key in ("driver", "idle_timeout_s"):
                if key in data:
                    raise ValueError(f"{key}: only a multi-turn (agentic) workload is driven by a "
                                     "worker or an agent; a single-turn session is one call either way")
        return data


class RlvrSpec(_WorkloadBase):
    """GRPO groups sharing one prompt; heavy-tailed single-turn reasoning outputs."""

    kind: Literal["rlvr"] = "rlvr"
    group_size: PosInt = 16  # DAPO, AReaL, Skywork 7B [V1] [A1] [K1]
    max_tokens: PosInt = 16_384  # DAPO response cap [V1]
    # Prompt LN(150, 0.6) cap 2,048 ([S2] 145–220 mean; [V1] [V2] caps).
    prompt: LogNormal = LogNormal(median=150, sigma=0.6, cap=2048)
    # Response median 4,000 ([R2] 5.5K mean, [A1] <5% over 27K, [S2] 5.0K mean). Total sigma
    # ≈0.8 split into a per-prompt factor shared by the group and a within-group factor
    # (assumption in WORKLOADS.md §1): √(0.5² + 0.6²) ≈ 0.78.
    output_median: PosFloat = 4_000
    prompt_sigma: NonNegFloat = 0.5
    within_group_sigma: NonNegFloat = 0.6


class RlhfSpec(_WorkloadBase):
    """Reward-model chat: medium prompts and responses, small groups."""

    kind: Literal["rlhf"] = "rlhf"
    group_size: PosInt = 4  # n = 2–4 for RLOO/GRPO-style runs; UltraFeedback 4 completions [U1]
    max_tokens: PosInt = 1_024  # OpenRLHF PPO generate_max_len [O1]
    # Prompt LN(170, 1.0) cap 1,024: mean 280, fits the 283-token context of [S2].
    prompt: LogNormal = LogNormal(median=170, sigma=1.0, cap=1024)
    # Response LN(300, 0.75): mean 397, between the 284 [H2] and 520 [S2] means.
    output: LogNormal = LogNormal(median=300, sigma=0.75)


class AgenticSpec(_WorkloadBase):
    """Multi-turn tool-use episodes: shared system prompt, task prompt shared by a group."""

    kind: Literal["agentic"] = "agentic"
    group_size: PosInt = 8  # DeepSWE 64 tasks × 8 trajectories [D1]
    max_tokens: PosInt = 4_096  # per-turn cap (assumption: ~p99.9 of the output fit below)
    max_turns: Annotated[int, Field(ge=1, le=1000)] = 50  # DeepSWE training step cap [D1]
    # Episodes stop before a turn whose prompt + max_tokens would pass this (DeepSWE 36K [D1]).
    max_context_tokens: PosInt = 36_864
    task_families: PosInt = 2  # distinct shared system prompts (assumption)
    system_prompt_tokens: PosInt = 3_000  # shared per task family (WORKLOADS.md §3 fit)
    # Task prompt: system + task ≤ 4,096 in DeepSWE [D1]; LN(700, 0.5) cap 1,096 keeps that.
    task_prompt: LogNormal = LogNormal(median=700, sigma=0.5, cap=1096)
    # Turns LN(28, 0.75) clipped to [3, max_turns]: mean 37 ([N1] SWE-Gym/R2E vs OpenHands means).
    turns: LogNormal = LogNormal(median=28, sigma=0.75)
    min_turns: PosInt = 3
    # Output/turn LN(300, 1.0), mean ~500, fits 523 tok/step [TL1]; ×3–5 for thinking models.
    output: LogNormal = LogNormal(median=300, sigma=1.0)
    # Observation LN(800, 1.3) cap 16K: p90 4.2K, p99 16K, fits appended-token bins [TL2].
    observation: LogNormal = LogNormal(median=800, sigma=1.3, cap=16_384)
    # Seconds between turns: the tool call (worker-driven) or everything the agent does
    # between two calls of the gateway (agent-driven; see scenarios/agent-driven.yaml).
    tool_latency: LogNormalMixture = DEFAULT_TOOL_LATENCY
    # Final test run LN(30 s, 1.0) cap 900 s (assumption within the 900 s test timeout of [X3]).
    final_latency: LogNormal | None = LogNormal(median=30.0, sigma=1.0, cap=900.0)
    # Who runs the turns. worker: the broker's worker runs the episode and reports when a tool
    # runs (waiting_on_tool). agent: the user's agent calls the OpenAI-compatible gateway once
    # per turn; between calls the broker knows only that the episode is between calls, and an
    # episode with no call for `idle_timeout_s` is parked: its ledger charge is released and
    # its next call is admitted again (docs/misa-t.md, "Agent-driven episodes").
    driver: Literal["worker", "agent"] = "worker"
    # agent only; None: the live gateway's default, DEFAULT_IDLE_TIMEOUT_S.
    idle_timeout_s: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None

    @property
    def parking_timeout_s(self) -> float | None:
        """Seconds between calls after which an agent-driven episode is parked (None: never,
        a worker-driven workload)."""
        if self.driver != "agent":
            return None
        return self.idle_timeout_s if self.idle_timeout_s is not None else DEFAULT_IDLE_TIMEOUT_S

    @model_validator(mode="after")
    def _consistent(self) -> AgenticSpec:
        if self.idle_timeout_s is not None and self.driver != "agent":
            raise ValueError("idle_timeout_s: only an agent-driven workload (driver: agent) is "
                             "parked between calls; a worker-driven one has no idle timeout")
        if self.min_turns > self.max_turns:
            raise ValueError(f"min_turns ({self.min_turns}) must be ≤ max_turns ({self.max_turns})")
        longest_first = self.system_prompt_tokens + int(self.task_prompt.cap or 0) + self.max_tokens
        if self.task_prompt.cap is None or longest_first > self.max_context_tokens:
            raise ValueError(
                "max_context_tokens must hold system_prompt_tokens + task_prompt.cap + max_tokens"
                " (task_prompt needs a cap)"
            )
        return self


WorkloadSpec = Annotated[RlvrSpec | RlhfSpec | AgenticSpec, Field(discriminator="kind")]
WORKLOAD_KINDS = ("rlvr", "rlhf", "agentic")


class FleetChange(BaseModel):
    """Engines joining or leaving the fleet mid-run, as an autoscaler (KEDA on the worker
    StatefulSet, deploy/k8s/overlays/gpu-autoscale) adds and removes worker pods.

    `add: n`: n new engines (same profile, fresh backend ids) join at `at_s`; the policy sees
    each from its first heartbeat. `remove: n`: the n most recently added engines still serving
    leave, as a StatefulSet scales in from its highest ordinal. A leaving engine drains as the
    live worker does on SIGTERM: it takes no admission from `at_s` on, its sessions run on for
    `drain_grace_s`, then every one still there is handed back to the queue with what it had
    generated (a cut turn's partial output included) to go on from it elsewhere (sim.fleet)."""

    model_config = _STRICT

    at_s: Annotated[float, Field(ge=0.0, allow_inf_nan=False)]  # virtual seconds from the start
    add: PosInt | None = None
    remove: PosInt | None = None
    # remove only: how long its sessions may still run before they are cut and handed back
    # (the live worker's --drain-grace, 30 s by default; 0 cuts them at once).
    drain_grace_s: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] | None = None

    @model_validator(mode="after")
    def _one_change(self) -> FleetChange:
        if (self.add is None) == (self.remove is None):
            raise ValueError("give exactly one of add (engines that join) and remove (engines "
                             "that leave)")
        if self.add is not None and self.drain_grace_s is not None:
            raise ValueError("drain_grace_s: only a remove drains engines")
        return self


class FleetSpec(BaseModel):
    model_config = _STRICT

    engines: PosInt  # at the start; `changes` adds and removes engines later
    # Resolved by the engine model (sim/engine); only its shape is checked here.
    profile: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9.\-]{0,63}$")]
    kv_tokens: PosInt | None = None  # override the profile's KV capacity (tokens per engine)
    # Override the profile's scheduler limits (vLLM's defaults for the GPU class), as a
    # deployment that passes --max-num-seqs / --max-num-batched-tokens does.
    max_num_seqs: PosInt | None = None
    max_num_batched_tokens: PosInt | None = None
    # vLLM's --scheduling-policy. Under `priority` the engines order waiting requests and pick
    # preemption victims by each request's priority; a broker's workers send each turn with
    # its session's admission time as the priority (oldest first), a router sends none (0).
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # LoRA (sim/engine/adapter_slots.py): adapters one engine step may mix (vLLM's
    # --max-loras; 0: LoRA off), and the seconds one adapter takes to load.
    max_loras: Annotated[int, Field(ge=0)] = 0
    lora_load_s: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.02
    # Scale-out and scale-in during the run, in time order (see FleetChange); none: a fixed fleet.
    changes: list[FleetChange] = Field(default_factory=list)

    @model_validator(mode="after")
    def _changes_keep_an_engine(self) -> FleetSpec:
        serving = self.engines
        for i, change in enumerate(self.changes):
            if i and change.at_s < self.changes[i - 1].at_s:
                raise ValueError(f"changes.{i}.at_s: {change.at_s:g} s is before the change "
                                 f"above it ({self.changes[i - 1].at_s:g} s): list them in time "
                                 "order")
            if change.remove is not None and change.remove >= serving:
                raise ValueError(f"changes.{i}.remove: removes {change.remove} at "
                                 f"{change.at_s:g} s, where {serving} serve: at least one "
                                 "engine must stay")
            serving += change.add or -change.remove
        return self

    @property
    def most_engines(self) -> int:
        """The most engines serving at once over the run (`engines` when none is added)."""
        serving = most = self.engines
        for change in self.changes:
            serving += change.add or -change.remove
            most = max(most, serving)
        return most


class WeightUpdateSpec(BaseModel):
    """Weight updates as RL frameworks push them to the engines: pause every engine (vLLM's
    `POST /pause?mode=`), load the new weights for `sync_s`, resume. The trainer stops sending
    while paused; see sim.fleet for what each mode does to requests in flight."""

    model_config = _STRICT

    # keep: freeze requests in place; abort: stop them (partial rollouts); wait: let them finish.
    mode: Literal["keep", "abort", "wait"] = "keep"
    sync_s: NonNegFloat  # from every engine paused to resume: loading the new weights
    every: PosInt = 1  # trainer iterations (sync: steps) per update
    partial: bool = True  # abort: resume a stopped session from its output (False: regenerate)
    clear_cache: bool = True  # abort/wait: drop the prefix cache before resuming (keep: in use)

    @model_validator(mode="after")
    def _mode_fields(self) -> WeightUpdateSpec:
        if self.mode != "abort" and not self.partial:
            raise ValueError("partial: only a mode=abort pause stops requests part-way")
        return self


class TrainerSpec(BaseModel):
    """The RL trainer: iterations of `batch_size` results; see sim.metrics.Trainer."""

    model_config = _STRICT

    iterations: PosInt
    batch_size: PosInt
    # async: refill a rollout buffer as results return; sync: one whole step at a time.
    loop: Literal["async", "sync"] = "async"
    mode: Literal["fifo", "quota"] = "fifo"  # how an async trainer takes its batches
    # Most sessions enqueued and not yet returned; the trainer refills up to it (async RL).
    inflight_bound: PosInt
    # async only: the producer is at most this many iterations ahead of the trainer.
    max_staleness: Annotated[int, Field(ge=0)] | None = None
    # Simulated seconds of training on a batch. sync: between one step's last result and the
    # next step; async (with weight_update only): from an iteration's batch to its weight update.
    train_s: NonNegFloat = 0.0
    # Push new weights to the engines every `every` iterations (None: the weights never change).
    weight_update: WeightUpdateSpec | None = None
    # buffer: closed loop, enqueue to keep the buffer full; recorded: replay trace arrival times.
    arrival: Literal["buffer", "recorded"] = "buffer"

    @model_validator(mode="after")
    def _loop_fields(self) -> TrainerSpec:
        if self.loop == "sync":
            if self.max_staleness is not None:
                raise ValueError("max_staleness: only an async loop has one")
            if self.arrival != "buffer":
                raise ValueError("arrival: a sync loop makes its own steps ('buffer' only)")
        elif self.train_s and self.weight_update is None:
            raise ValueError("train_s: an async loop trains while rollouts run; it only delays a "
                             "weight_update, so set one")
        return self


class TelemetrySpec(BaseModel):
    """What the policy learns of the engines, and when, as the live system delivers it: a
    heartbeat every `heartbeat_s` carrying the engine's /metrics and each session's progress
    as they were `lag_s` earlier (the worker scrapes /metrics about once a second and beats
    the latest scrape; its mean age at the broker is about half a period). KV usage is
    counted in whole 16-token blocks, as vLLM reports it. `lag_s: 0` gives exact, instant
    feedback (an idealisation no live broker has).

    `progress` is what a beat says of a turn the engine is still generating. `turn_end` (the
    default) is what the worker reports: it sends each turn as one request and learns its
    output when the engine answers, so until then the session shows the turn's prompt.
    `decoding` reports the tokens the engine has decoded so far, what a worker streaming its
    requests would know."""

    model_config = _STRICT

    heartbeat_s: PosFloat = 1.0
    lag_s: NonNegFloat = 0.5
    progress: Literal["turn_end", "decoding"] = "turn_end"


class LimitsSpec(BaseModel):
    model_config = _STRICT

    max_sim_time_s: PosFloat = 86_400.0  # virtual seconds before the run is cut off
    max_wall_s: PosFloat = 600.0  # wall seconds before the run is cut off


class Scenario(BaseModel):
    model_config = _STRICT

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    seed: Annotated[int, Field(ge=0)]
    fleet: FleetSpec
    source: Literal["generators", "trace"] = "generators"
    trace: str | None = None  # JSONL path, relative to the scenario file, for source: trace
    # Keyed by workload name (the Session.workload); `kind` defaults to the key.
    workloads: dict[str, WorkloadSpec] = Field(default_factory=dict)
    mixture: Annotated[dict[str, Annotated[float, Field(ge=0.0, le=1.0)]], Field(min_length=1)]
    trainer: TrainerSpec
    vocab_size: Annotated[int, Field(ge=2, le=1_000_000)] = 151_936  # Qwen3 embedding rows
    telemetry: TelemetrySpec = TelemetrySpec()
    limits: LimitsSpec = LimitsSpec()

    @model_validator(mode="before")
    @classmethod
    def _kind_from_key(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("workloads"), dict):
            filled = {}
            for key, spec in data["workloads"].items():
                if isinstance(spec, dict) and "kind" not in spec and key in WORKLOAD_KINDS:
                    spec = {**spec, "kind": key}
                filled[key] = spec
            data = {**data, "workloads": filled}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Scenario:
        total = sum(self.mixture.values())
        if not math.isclose(total, 1.0, abs_tol=1e-6):
            raise ValueError(f"mixture: shares must sum to 1 (they sum to {total:g})")
        if self.source == "trace":
            if not self.trace:
                raise ValueError("trace: required when source is 'trace'")
            if self.workloads:
                raise ValueError("workloads: must be empty when source is 'trace'")
        else:
            if self.trace is not None:
                raise ValueError("trace: only allowed when source is 'trace'")
            if self.trainer.arrival == "recorded":
                raise ValueError("trainer.arrival: 'recorded' needs source 'trace'")
            if set(self.mixture) != set(self.workloads):
                raise ValueError(
                    f"mixture: keys {sorted(self.mixture)} must equal workloads"
                    f" {sorted(self.workloads)}"
                )
            for name, w in self.workloads.items():
                if w.adapters and not self.fleet.max_loras:
                    raise ValueError(f"workloads.{name}.adapters: LoRA adapters need engines "
                                     "with LoRA on: set fleet.max_loras (vLLM's --max-loras)")
            biggest = max(w.group_size for w in self.workloads.values())
            if self.trainer.inflight_bound < biggest:
                raise ValueError(
                    f"trainer.inflight_bound: must be ≥ the largest group_size ({biggest}),"
                    " or no group could ever be enqueued"
                )
        return self

    def max_turns(self, workload: str) -> int:
        spec = self.workloads[workload]
        return spec.max_turns if isinstance(spec, AgenticSpec) else 1


def _reason(err: dict[str, Any]) -> str:
    ctx = err.get("ctx") or {}
    kind = err["type"]
    if kind == "greater_than_equal":
        return f"must be ≥ {ctx['ge']}"
    if kind == "greater_than":
        return f"must be > {ctx['gt']}"
    if kind == "less_than_equal":
        return f"must be ≤ {ctx['le']}"
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "required field is missing"
    if kind == "union_tag_invalid":
        return f"kind must be one of {', '.join(WORKLOAD_KINDS)}"
    if kind == "finite_number":
        return "must be a finite number"
    if kind == "literal_error":
        return f"must be {ctx['expected']}"
    if kind == "union_tag_not_found":
        return f"needs a kind ({', '.join(WORKLOAD_KINDS)}) when the key is not one"
    msg = str(err["msg"])
    return msg.removeprefix("Value error, ")


def _loc(loc: tuple[Any, ...]) -> str:
    # Pydantic puts the union tag after the workload key (workloads.rlvr.rlvr.x): drop it.
    parts = list(loc)
    if len(parts) >= 3 and parts[0] == "workloads" and parts[2] in WORKLOAD_KINDS:
        del parts[2]
    return ".".join(str(p) for p in parts)


def parse_scenario(data: Any, origin: str = "scenario") -> Scenario:
    """Validate already-parsed YAML/JSON; errors are prefixed with `origin`."""
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = _loc(err["loc"])
            lines.append(f"{origin}: {where}: {_reason(err)}" if where else f"{origin}: {_reason(err)}")
        raise ScenarioError("\n".join(lines)) from None


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ScenarioError(f"{path.name}: cannot read: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ScenarioError(f"{path.name}{line}: YAML syntax error: {exc.problem}") from None
    if not isinstance(data, dict):
        raise ScenarioError(f"{path.name}: must be a mapping of fields, got {type(data).__name__}")
    return parse_scenario(data, path.name)


def resolve_trace_path(scenario: Scenario, scenario_path: str | Path) -> Path:
    """The trace file of a `source: trace` scenario, relative to the scenario file."""
    if scenario.trace is None:
        raise ScenarioError(f"{Path(scenario_path).name}: trace: not set")
    trace = Path(scenario.trace)
    return trace if trace.is_absolute() else Path(scenario_path).parent / trace
