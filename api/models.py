"""What crosses HTTP, split by direction: `*In` is a request body, `*Public` a response."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from broker.session import Session, SessionState

MAX_BATCH = 10_000  # sessions in one POST /v1/sessions; the client chunks bigger batches itself


class ErrorPublic(BaseModel):
    """Every error answer: which input was wrong (None when it is not one field) and why."""

    field: str | None
    reason: str


# -- sessions ------------------------------------------------------------------------------------
class SessionBatchIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sessions: Annotated[list[Session], Field(min_length=1, max_length=MAX_BATCH)]


class EnqueuePublic(BaseModel):
    enqueued: list[str]  # ids added now
    duplicates: list[str]  # ids the namespace had seen before: left untouched (idempotent)


class SessionPublic(BaseModel):
    """A session's state hash (see broker/queue.py), timestamps in unix seconds."""

    session_id: str
    state: SessionState
    workload: str
    backend_id: str | None = None
    reserved_tokens: int | None = None
    enqueued_at: float | None = None
    admitted_at: float | None = None
    running_at: float | None = None
    finished_at: float | None = None
    requeued_at: float | None = None
    session: Session | None = None  # None only if the stored JSON cannot be read


class CancelPublic(BaseModel):
    session_id: str
    cancelled: bool  # False: it had already finished (state says how)
    state: SessionState


# -- mixture -------------------------------------------------------------------------------------
class MixtureIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # workload -> target share π_w of consumed sessions; sums to 1. A JSON number, finite:
    # neither a string nor a boolean is read as one.
    shares: dict[str, Annotated[float, Field(strict=True, allow_inf_nan=False)]]


class MixturePublic(BaseModel):
    shares: dict[str, float]


# -- weight updates ------------------------------------------------------------------------------
class PauseIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["abort", "wait", "keep"] = "keep"  # vLLM's pause modes
    timeout_s: Annotated[float, Field(gt=0, le=600, strict=True, allow_inf_nan=False)] = 30.0


class ResumeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Annotated[int, Field(ge=0, strict=True)]  # the policy version now loaded


class StalenessIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_staleness: Annotated[int, Field(ge=0, strict=True)] | None  # null: no bound


class WeightsPublic(BaseModel):
    paused: str  # the pause mode in force; '' while generating
    version: int | None  # the policy version the engines serve; null before any resume
    max_staleness: int | None = None  # the staleness bound; null: none
    paused_backends: list[str] = Field(default_factory=list)  # engines paused by this call
    # LoRA adapters paused for an adapter-only update -> the pause mode
    paused_adapters: dict[str, str] = Field(default_factory=dict)


# -- status --------------------------------------------------------------------------------------
class LatencyStatus(BaseModel):
    """Enqueue-to-result latency of the sessions finished in the last `window_s` seconds
    (quantiles from √2-wide buckets, broker/latency.py)."""

    window_s: float  # the span covered (shorter while the API has been up less than a window)
    finished: int  # results counted
    p50_s: float
    p95_s: float
    p99_s: float


class WorkloadStatus(BaseModel):
    workload: str
    depth: int  # sessions waiting for admission: pending + requeued entries
    requeued: int  # of `depth`, taken back from dead backends (admitted before the rest)
    oldest_pending_age_s: float | None  # None when nothing waits
    finished_total: int  # results published (done or failed)
    failed_total: int  # of those, failed
    consumed_total: int  # results the trainer acknowledged
    latency: LatencyStatus | None = None  # None: nothing finished in the window
    # bucket -> results ever counted in it (broker/latency.py); for /metrics, not in the JSON
    latency_buckets_total: dict[int, int] = Field(default_factory=dict, exclude=True)


class BackendStatus(BaseModel):
    backend_id: str
    healthy: bool  # its heartbeat key exists (the TTL is the health signal)
    capacity_tokens: int  # C_b
    max_model_len: int
    alpha: float  # α_b: reservations may reach α_b·C_b
    limit_tokens: int  # floor(α_b·C_b)
    reserved_tokens: int
    reserved_by_workload: dict[str, int]
    sessions: int  # sessions resident (holding a reservation)
    admitted_total: int | None  # sessions ever admitted to it; None if its stream is gone
    # the engine's own usage, 0..1 (on a shared engine, of this namespace's part: above 1 while
    # it holds more); None without a heartbeat
    kv_usage: float | None
    running: int | None
    waiting: int | None
    preemptions_total: int | None
    prefix_hit_rate: float | None  # hits / queries as vLLM counts them, since engine start
    prefix_cache_queries_total: int | None  # prompt tokens looked up (vLLM's counter)
    prefix_cache_hits_total: int | None  # of those, served from the prefix cache
    heartbeat_age_s: float | None
    # On an engine several namespaces share (docs/fleet.md): this namespace's guaranteed share
    # and the KV tokens it may plan against now (None: the engine is this namespace's alone).
    share: float | None = None
    part_tokens: int | None = None


class MixtureStatus(BaseModel):
    target: dict[str, float]
    consumed_total: dict[str, int]
    consumed_window: dict[str, int]  # acknowledged within the last `window_s`
    window_s: float  # span the window really covers (shorter just after the API started)
    drift_total: float | None  # ½·Σ|consumed share − target|; None without target or consumption
    drift_window: float | None


class ThroughputWindow(BaseModel):
    window_s: float  # the window asked for
    covered_s: float  # the span measured (shorter just after the API started)
    sessions_per_s: float
    by_workload: dict[str, float]
    tokens_per_s: float  # output tokens of the results published in the window, per second
    tokens_by_workload: dict[str, float]


class BrokerStatus(BaseModel):
    lease_held: bool  # some broker holds the namespace's lease (is active)
    policy: str | None = None  # the active broker's policy
    holder: str | None = None  # the active broker's consumer id


class ChartPoint(BaseModel):
    at: float  # unix seconds of the status read
    queue: dict[str, int]  # workload -> depth
    kv: dict[str, float]  # backend -> KV usage 0..1
    drift: dict[str, float]  # "recent", "total"


class HistoryPublic(BaseModel):
    now: float  # the server's clock when it answered (place samples at now - (now - at))
    samples: list[ChartPoint]


class StatusPublic(BaseModel):
    at: float  # unix seconds the status was read
    namespace: str
    broker: BrokerStatus
    workloads: list[WorkloadStatus]
    backends: list[BackendStatus]
    mixture: MixtureStatus
    throughput: list[ThroughputWindow]
    results_unacknowledged: int  # results published and not yet acknowledged by the trainer
    dead_letter: int  # entries in the dead-letter stream


# -- health --------------------------------------------------------------------------------------
class HealthPublic(BaseModel):
    status: str


class ReadyPublic(BaseModel):
    ready: bool
    redis: bool
    broker_lease: bool
    live_workers: int  # workers whose heartbeat has not expired
    reason: str | None = None
