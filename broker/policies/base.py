"""The policy interface: one pure `decide(snapshot) -> Decision`, shared by both drivers.

The live broker builds a `Snapshot` from Redis; the fleet simulator builds it from simulated
engines. A policy never touches Redis, HTTP, the clock or logging: everything it may know is a
field of the snapshot. Facts only a simulated world knows (true output lengths, tool latencies)
have no field here, by construction.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import ClassVar

BLOCK_SIZE = 16  # tokens per KV block, as vLLM's default; prefix matching works in whole blocks


@dataclass(frozen=True, slots=True)
class PendingItem:
    """A placement request: a new session, or a follow-up turn that needs a backend.

    The live broker only ever places whole sessions (its workers run every turn locally), so
    there `turn == 0`. The simulator's router mode re-places each agentic turn the way an HTTP
    router sees them, with `turn > 0` and `home_backend` set.
    """

    session_id: str
    workload: str
    group_id: str | None
    group_size: int
    prompt_tokens: int  # tokens this placement will prefill (whole history for a follow-up turn)
    prefix: tuple[int, ...]  # the prompt as a sequence for prefix matching: token ids, or UTF-8 bytes of a text prompt
    max_tokens: int  # per-turn output cap
    max_turns: int
    turn: int  # 0 for a new session
    home_backend: str | None  # where the session's earlier turns ran; None for a new session
    enqueued_at: float
    model: str | None = None  # the served model it needs; None: any
    adapter: str | None = None  # the LoRA adapter its requests run with; None: the base model


@dataclass(frozen=True, slots=True)
class Telemetry:
    """The latest heartbeat of a backend: its engine's own /metrics, as vLLM names them."""

    at: float  # when the heartbeat was taken
    kv_usage: float  # vllm:kv_cache_usage_perc, 0..1 (of a shared engine's part: may exceed 1)
    running: int  # vllm:num_requests_running
    waiting: int  # vllm:num_requests_waiting
    preemptions_total: int  # vllm:num_preemptions_total
    prefix_queries_total: int  # vllm:prefix_cache_queries_total (tokens)
    prefix_hits_total: int  # vllm:prefix_cache_hits_total (tokens)


@dataclass(frozen=True, slots=True)
class ResidentSession:
    """A session admitted to a backend and not yet finished, with its reported progress."""

    session_id: str
    workload: str
    group_id: str | None
    reserved_tokens: int  # KV tokens the ledger charges it now
    prompt_tokens: int  # first-turn prompt length
    context_tokens: int  # current history length (prompt + outputs + observations so far)
    generated_tokens: int  # output tokens produced so far, all turns
    turn: int  # turns started so far
    max_tokens: int
    max_turns: int
    waiting_on_tool: bool  # between turns: a tool or reward call is running
    admitted_at: float
    adapter: str | None = None  # the LoRA adapter its requests run with


_WAITING_ON_TOOL = attrgetter("waiting_on_tool")


@dataclass(frozen=True, slots=True)
class BackendView:
    backend_id: str
    capacity_tokens: int  # C_b: num_gpu_blocks × block_size as the engine reports it
    max_model_len: int
    healthy: bool  # heartbeat fresh and engine answering
    alpha: float  # admission limit factor: reservations may reach alpha × capacity
    telemetry: Telemetry | None
    sessions: tuple[ResidentSession, ...] = ()
    model: str | None = None  # the model its engine serves (None: not reported)
    # LoRA: how many adapters one engine step may mix (vLLM's --max-loras; 0: LoRA off), and
    # the adapters the engine has loaded (a session with one of them starts without a load).
    max_loras: int = 0
    adapters: frozenset[str] = frozenset()
    # The engine serves other namespaces too (broker/shares.py): `capacity_tokens` and
    # `max_loras` are this namespace's part of it now, and its admissions must stay in them.
    shared: bool = False

    @property
    def reserved_tokens(self) -> int:
        return sum(s.reserved_tokens for s in self.sessions)

    @property
    def in_flight(self) -> int:
        """Sessions with a request on the engine now (not parked on a tool call)."""
        # C-level count: routers read this for every backend on every decide().
        return len(self.sessions) - sum(map(_WAITING_ON_TOOL, self.sessions))


def serves(view: BackendView, item: PendingItem) -> bool:
    """Whether `view`'s engine can run `item` at all: it serves the item's model (a backend
    that reported none serves any), and LoRA is on where the item names an adapter. Whether
    an adapter slot is free is the placing policy's to judge (`adapters_in_use`)."""
    return ((item.model is None or view.model is None or item.model == view.model)
            and (item.adapter is None or view.max_loras > 0))


def adapters_in_use(view: BackendView) -> set[str]:
    """The adapters of `view`'s resident sessions: each holds one of its engine's `max_loras`
    slots while any of its sessions runs there (vLLM's scheduler mixes at most that many
    adapters in a step and leaves a request waiting whose adapter would exceed it)."""
    return {s.adapter for s in view.sessions if s.adapter is not None}


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished session, as the results stream reports it (feeds online predictors)."""

    session_id: str
    workload: str
    backend_id: str
    prompt_tokens: int
    output_tokens: int  # summed over turns
    turn_output_tokens: tuple[int, ...]
    turns: int
    tool_wait_s: float  # total time spent between turns
    kv_token_seconds: float  # ∫ resident KV tokens dt over the session's residency
    admitted_at: float
    finished_at: float
    truncated: bool  # some turn stopped at max_tokens


@dataclass(frozen=True, slots=True)
class Snapshot:
    now: float
    pending: Mapping[str, tuple[PendingItem, ...]]  # by workload, oldest first
    backends: tuple[BackendView, ...]
    mixture_target: Mapping[str, float]  # π_w, sums to 1
    consumed: Mapping[str, int]  # results consumed by the trainer so far, per workload
    new_completions: tuple[Completion, ...] = ()  # finished since the previous decide()


@dataclass(frozen=True, slots=True)
class Admission:
    session_id: str
    backend_id: str
    reserved_tokens: int  # KV tokens the ledger charges for this session on admission


@dataclass(slots=True)
class Decision:
    admissions: list[Admission] = field(default_factory=list)
    alpha: dict[str, float] = field(default_factory=dict)  # new α for backends whose α changed
    recharge: dict[str, int] = field(default_factory=dict)  # session_id -> new reservation


class Policy(ABC):
    """An admission and placement rule. Stateful (predictors, α) but pure: no I/O of any kind."""

    name: ClassVar[str]
    # Router baselines place every request the moment it arrives and let the engine queue it.
    dispatch_on_arrival: ClassVar[bool] = False
    # Whether decide() reads a resident session's heartbeat progress (context_tokens,
    # generated_tokens, turn). A driver may skip refreshing progress for a policy that does not.
    reads_progress: ClassVar[bool] = True
    # A reference only the simulator can run (it needs what a live broker cannot know).
    simulator_only: ClassVar[bool] = False

    @abstractmethod
    def decide(self, snapshot: Snapshot) -> Decision:
        """Return admissions for some pending items. Never admit an item twice."""

    def recall(self, history: Sequence[Completion]) -> None:
        """Completions that finished before this policy object existed (kept in Redis: a
        restarted broker, a standby taking over, a new run in the namespace), oldest first,
        before the first `decide`. Policies without a model ignore them."""


def kv_token_seconds(turns: Iterable[tuple[int, int, float]],
                     waits: Iterable[tuple[int, float]] = ()) -> float:
    """∫ resident KV tokens dt over a session's residency: the one definition the simulator,
    the worker and MISA-T's prior share (`Completion.kv_token_seconds`).

    `turns`: (prompt tokens, output tokens, seconds from the request's submission to its last
    token) — the context grows linearly from the prompt to prompt + output over the turn.
    `waits`: (history tokens, seconds) between turns, while a tool runs — the whole history
    stays resident."""
    return (sum(p * s + o * s / 2.0 for p, o, s in turns)
            + sum(h * s for h, s in waits))


def default_reservation(item: PendingItem) -> int:
    """Charge for policies without a length model: the prompt plus the whole output cap."""
    return item.prompt_tokens + item.max_tokens
