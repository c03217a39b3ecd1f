"""Weight updates: pause generation, resume on a new policy version (broker/weights.py),
through `RolloutClient` as a Python trainer does it."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import AuthDep, ClientDep
from api.errors import ApiError, from_value_error
from api.limits import TOO_LARGE
from api.models import ErrorPublic, PauseIn, ResumeIn, StalenessIn, WeightsPublic
from broker.weights import WeightsState

router = APIRouter(prefix="/v1/weights", tags=["weights"])
# The endpoints that take a body: it may not parse (400), be too large (413) or be invalid (422).
_ERRORS = {400: {"model": ErrorPublic}, 401: {"model": ErrorPublic},
           422: {"model": ErrorPublic}, **TOO_LARGE}


def _public(state: WeightsState, paused_backends: list[str] | None = None) -> WeightsPublic:
    return WeightsPublic(paused=state.paused, version=state.version,
                         max_staleness=state.max_staleness,
                         paused_backends=paused_backends or [],
                         paused_adapters={a: mode for a, (mode, _) in
                                          state.paused_adapters.items()})


@router.get("", response_model=WeightsPublic)
def get_weights(client: ClientDep) -> WeightsPublic:
    return _public(client.weights())


@router.post("/pause", response_model=WeightsPublic, dependencies=[AuthDep],
             responses={**_ERRORS, 409: {"model": ErrorPublic}})
def pause(body: PauseIn, client: ClientDep) -> WeightsPublic:
    """Stop admission and pause every live engine with vLLM's `mode`; answers once all are
    paused (409 naming the ones that were not within `timeout_s`: generation stays paused;
    retry, or resume)."""
    try:
        backends = client.pause(body.mode, body.timeout_s)
    except TimeoutError as exc:
        raise ApiError(409, "timeout_s", str(exc).partition(": ")[2] or str(exc)) from None
    return _public(client.weights(), backends)


@router.post("/resume", response_model=WeightsPublic, dependencies=[AuthDep],
             responses=_ERRORS)
def resume(body: ResumeIn, client: ClientDep) -> WeightsPublic:
    """Resume the engines on policy `version`; admission restarts."""
    try:
        client.resume(body.version)
    except ValueError as exc:
        raise from_value_error(exc) from None
    return _public(client.weights())


@router.post("/adapters/{name}/pause", response_model=WeightsPublic, dependencies=[AuthDep],
             responses={**_ERRORS, 409: {"model": ErrorPublic}})
def pause_adapter(name: str, body: PauseIn, client: ClientDep) -> WeightsPublic:
    """Pause what serves LoRA adapter `name` for an adapter-only update: its sessions wait,
    the engines that have it loaded pause with `mode`; answers once every live worker has
    acknowledged (409 as for a pause)."""
    try:
        backends = client.pause_adapter(name, body.mode, body.timeout_s)
    except TimeoutError as exc:
        raise ApiError(409, "timeout_s", str(exc).partition(": ")[2] or str(exc)) from None
    except ValueError as exc:
        raise from_value_error(exc) from None
    return _public(client.weights(), backends)


@router.post("/adapters/{name}/resume", response_model=WeightsPublic, dependencies=[AuthDep],
             responses=_ERRORS)
def resume_adapter(name: str, client: ClientDep) -> WeightsPublic:
    """End adapter `name`'s pause: its engines load its registered weights and resume."""
    try:
        client.resume_adapter(name)
    except ValueError as exc:
        raise from_value_error(exc) from None
    return _public(client.weights())


@router.put("/staleness", response_model=WeightsPublic, dependencies=[AuthDep],
            responses=_ERRORS)
def set_staleness(body: StalenessIn, client: ClientDep) -> WeightsPublic:
    """Bound how many policy versions behind the engines' a session may be (null: none)."""
    client.set_max_staleness(body.max_staleness)
    return _public(client.weights())
