"""Heartbeat records: what a worker stores under `rb:{ns}:hb:<backend>` every ~1 s, with a TTL.

The record is JSON (a pydantic model), never pickle. The key's TTL is the health signal: a
backend is healthy exactly while its heartbeat key exists (see `lua/heartbeat.lua`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from broker.policies.base import Telemetry

DEFAULT_HEARTBEAT_TTL_S = 3.0  # three missed 1 s beats and the backend counts as dead


class SessionProgress(BaseModel):
    """A resident session's progress as the worker sees it."""

    model_config = ConfigDict(extra="forbid")

    session_id: str
    context_tokens: int = Field(ge=0)  # history length now: prompt + outputs + observations
    generated_tokens: int = Field(ge=0)  # output tokens so far, all turns
    turn: int = Field(ge=0)  # turns started so far
    waiting_on_tool: bool = False  # between turns: a tool or reward call is running


class EngineMetrics(BaseModel):
    """The engine's own /metrics, under vLLM's names (see `Telemetry`)."""

    model_config = ConfigDict(extra="forbid")

    # 0..1; on a shared engine (`HeartbeatRecord.shared`) of the namespace's part, and above 1
    # while the namespace holds more than its part
    kv_usage: float = Field(ge=0.0)
    running: int = Field(ge=0)
    waiting: int = Field(ge=0)
    preemptions_total: int = Field(ge=0)
    prefix_queries_total: int = Field(ge=0)
    prefix_hits_total: int = Field(ge=0)


class SharedPart(BaseModel):
    """On an engine several namespaces share (broker/shares.py): this namespace's part of it.
    The beat's `metrics.kv_usage` is then this namespace's KV in use as a fraction of
    `capacity_tokens` (above 1 while it holds more than that); the engine's queue and
    preemption counters stay the engine's."""

    model_config = ConfigDict(extra="forbid")

    capacity_tokens: int = Field(ge=1)  # the KV this namespace may plan against now
    share: float = Field(gt=0.0, le=1.0)  # its guaranteed fraction of the engine
    foreign_adapters: int = Field(default=0, ge=0)  # LoRA slots the other namespaces hold
    namespaces: int = Field(ge=2)  # how many namespaces the engine serves


class HeartbeatRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    backend_id: str
    at: float  # unix seconds when the metrics were taken (older than the beat if /metrics lags)
    metrics: EngineMetrics
    sessions: list[SessionProgress] = Field(default_factory=list)  # every session running there
    sent_at: float | None = None  # unix seconds when the worker sent this beat
    adapters: list[str] = Field(default_factory=list)  # LoRA adapters its engine has loaded
    # The worker drains (SIGTERM: a scale-in, a rollout): it still beats while its sessions
    # finish, but takes no new one; the broker places nothing there.
    draining: bool = False
    shared: SharedPart | None = None  # None: the engine serves this namespace alone

    @model_validator(mode="after")
    def _usage_within_the_engine(self) -> HeartbeatRecord:
        if self.shared is None and self.metrics.kv_usage > 1.0:
            raise ValueError(f"metrics.kv_usage: {self.metrics.kv_usage} is above 1 on an engine "
                             "this namespace has alone (only a shared engine's part can be "
                             "overfull)")
        return self

    def telemetry(self) -> Telemetry:
        m = self.metrics
        return Telemetry(
            at=self.at, kv_usage=m.kv_usage, running=m.running, waiting=m.waiting,
            preemptions_total=m.preemptions_total, prefix_queries_total=m.prefix_queries_total,
            prefix_hits_total=m.prefix_hits_total,
        )

    def progress_by_session(self) -> dict[str, SessionProgress]:
        return {p.session_id: p for p in self.sessions}


def admits(hb: HeartbeatRecord | None) -> bool:
    """A backend takes admissions while it beats (`hb`, its latest; None when its key lapsed),
    unless its worker drains."""
    return hb is not None and not hb.draining


def parse_heartbeat(raw: bytes | str | None) -> HeartbeatRecord | None:
    """The stored record, or None when absent or unreadable (an unreadable beat is not health)."""
    if raw is None:
        return None
    try:
        return HeartbeatRecord.model_validate_json(raw)
    except ValidationError:
        return None
