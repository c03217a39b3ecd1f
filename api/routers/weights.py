"""Weight updates: pause generation, resume on a new policy version (broker/weights.py),
through `RolloutClient` as a Python trainer does it."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import AuthDep, ClientDep
from api.errors import ApiError, from_value_error
from api.models import ErrorPublic, PauseIn, ResumeIn, WeightsPublic

router = APIRouter(prefix="/v1/weights", tags=["weights"])
_ERRORS = {401: {"model": ErrorPublic}, 422: {"model": ErrorPublic}}


@router.get("", response_model=WeightsPublic)
def get_weights(client: ClientDep) -> WeightsPublic:
    state = client.weights()
    return WeightsPublic(paused=state.paused, version=state.version)


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
    state = client.weights()
    return WeightsPublic(paused=state.paused, version=state.version, paused_backends=backends)


@router.post("/resume", response_model=WeightsPublic, dependencies=[AuthDep],
             responses=_ERRORS)
def resume(body: ResumeIn, client: ClientDep) -> WeightsPublic:
    """Resume the engines on policy `version`; admission restarts."""
    try:
        client.resume(body.version)
    except ValueError as exc:
        raise from_value_error(exc) from None
    state = client.weights()
    return WeightsPublic(paused=state.paused, version=state.version)
