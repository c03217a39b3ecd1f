"""Liveness (the process answers) and readiness (Redis answers and a broker is active)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from api.deps import KeysDep
from api.errors import redis_reason
from api.models import HealthPublic, ReadyPublic

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthPublic)
async def healthz() -> HealthPublic:
    return HealthPublic(status="ok")


@router.get("/readyz", response_model=ReadyPublic, responses={503: {"model": ReadyPublic}})
async def readyz(request: Request, keys: KeysDep) -> ReadyPublic | JSONResponse:
    state = request.app.state
    try:
        await state.redis.ping()
        lease = bool(await state.redis.exists(keys.lease))
    except (RedisError, OSError) as exc:
        state.redis_outage.failed(exc)
        body = ReadyPublic(ready=False, redis=False, broker_lease=False, reason=redis_reason(exc))
        return JSONResponse(body.model_dump(), status_code=503)
    state.redis_outage.answered()
    if not lease:
        body = ReadyPublic(ready=False, redis=True, broker_lease=False,
                           reason="broker: no broker holds this namespace's lease")
        return JSONResponse(body.model_dump(), status_code=503)
    return ReadyPublic(ready=True, redis=True, broker_lease=True)
