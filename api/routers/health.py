"""Liveness (the process answers) and readiness (Redis answers, a broker is active, and at least
one worker beats: with none, nothing enqueued would ever run)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from api.deps import KeysDep
from api.errors import redis_reason
from api.models import HealthPublic, ReadyPublic
from broker.streams import as_text

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
        registered = sorted(as_text(b) for b in await state.redis.smembers(keys.backends))
        workers = await state.redis.exists(*map(keys.heartbeat, registered)) if registered else 0
    except (RedisError, OSError) as exc:
        state.redis_outage.failed(exc)
        body = ReadyPublic(ready=False, redis=False, broker_lease=False, live_workers=0,
                           reason=redis_reason(exc))
        return JSONResponse(body.model_dump(), status_code=503)
    state.redis_outage.answered()
    reason = None
    if not lease:
        reason = "broker: no broker holds this namespace's lease"
    elif not workers:
        reason = f"workers: none beats ({len(registered)} registered); nothing would run"
    if reason is not None:
        body = ReadyPublic(ready=False, redis=True, broker_lease=lease, live_workers=workers,
                           reason=reason)
        return JSONResponse(body.model_dump(), status_code=503)
    return ReadyPublic(ready=True, redis=True, broker_lease=True, live_workers=workers)
