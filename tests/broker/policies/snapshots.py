"""Tiny hand-built snapshots for the policy tests."""

from __future__ import annotations

from broker.policies.base import BackendView, PendingItem, ResidentSession, Snapshot


def item(
    session_id: str,
    prefix: tuple[int, ...] = (),
    *,
    workload: str = "rlhf",
    enqueued_at: float = 0.0,
    turn: int = 0,
    home_backend: str | None = None,
) -> PendingItem:
    return PendingItem(
        session_id=session_id,
        workload=workload,
        group_id=None,
        group_size=1,
        prompt_tokens=len(prefix),
        prefix=prefix,
        max_tokens=100,
        max_turns=1 if turn == 0 else turn + 1,
        turn=turn,
        home_backend=home_backend,
        enqueued_at=enqueued_at,
    )


def resident(session_id: str, *, waiting_on_tool: bool = False) -> ResidentSession:
    return ResidentSession(
        session_id=session_id,
        workload="rlhf",
        group_id=None,
        reserved_tokens=10,
        prompt_tokens=5,
        context_tokens=5,
        generated_tokens=0,
        turn=1,
        max_tokens=5,
        max_turns=1,
        waiting_on_tool=waiting_on_tool,
        admitted_at=0.0,
    )


def backend(
    backend_id: str, in_flight: int = 0, *, healthy: bool = True, parked: int = 0
) -> BackendView:
    """A backend with `in_flight` sessions on the engine and `parked` waiting on a tool."""
    return BackendView(
        backend_id=backend_id,
        capacity_tokens=1000,
        max_model_len=1000,
        healthy=healthy,
        alpha=1.0,
        telemetry=None,
        sessions=tuple(resident(f"{backend_id}-r{i}") for i in range(in_flight))
        + tuple(resident(f"{backend_id}-p{i}", waiting_on_tool=True) for i in range(parked)),
    )


def snapshot(
    backends: list[BackendView], items: list[PendingItem], *, now: float = 0.0
) -> Snapshot:
    pending: dict[str, list[PendingItem]] = {}
    for it in items:
        pending.setdefault(it.workload, []).append(it)
    return Snapshot(
        now=now,
        pending={w: tuple(v) for w, v in pending.items()},
        backends=tuple(backends),
        mixture_target={"rlhf": 1.0},
        consumed={},
    )


def placements(decision) -> list[tuple[str, str]]:
    return [(a.session_id, a.backend_id) for a in decision.admissions]
