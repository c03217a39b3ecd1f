"""Request dependencies. Clients live on `app.state`, made in the app's lifespan (the async
one connects on first use) or on first need (the trainer client, which writes on creation).

The lookups are `async def`: FastAPI runs a plain `def` dependency in its thread pool, and
those hops were a large part of a status request's cost. The ones handing out a Redis client
yield it: a request that then ends without an error found Redis answering, which ends an
outage (`api.errors.RedisOutage`)."""

from __future__ import annotations

import secrets
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import suppress
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from api.errors import ApiError
from api.settings import ApiSettings
from api.status import StatusReader
from broker.client import RolloutClient
from broker.keys import Keys


async def get_app_settings(request: Request) -> ApiSettings:
    return request.app.state.settings


SettingsDep = Annotated[ApiSettings, Depends(get_app_settings)]


async def get_redis(request: Request) -> AsyncIterator[aioredis.Redis]:
    yield request.app.state.redis
    request.app.state.redis_outage.answered()


RedisDep = Annotated[aioredis.Redis, Depends(get_redis)]


async def get_keys(settings: SettingsDep) -> Keys:
    return Keys(settings.namespace)


KeysDep = Annotated[Keys, Depends(get_keys)]


async def get_status_reader(request: Request) -> AsyncIterator[StatusReader]:
    yield request.app.state.status_reader
    request.app.state.redis_outage.answered()


StatusReaderDep = Annotated[StatusReader, Depends(get_status_reader)]

_client_lock = threading.Lock()


def get_client(request: Request) -> Iterator[RolloutClient]:
    """The trainer client the mutating endpoints reuse (validation, idempotency, cancel).

    A sync dependency: FastAPI runs it, and the endpoints using it, in its thread pool. It does
    not wait out an outage (`outage_timeout_s=0`: only the connection's own brief retries), so
    a request finding Redis down is answered 503 at once. A lost connection discards it: the
    next request makes a new one, which connects afresh and seeds the namespace's workloads
    again should Redis have come back empty."""
    state = request.app.state
    with _client_lock:
        if state.rollout_client is None:
            s: ApiSettings = state.settings
            state.rollout_client = RolloutClient(s.redis_url, s.namespace, consumer="api",
                                                 outage_timeout_s=0)
        client = state.rollout_client
    try:
        yield client
    except (RedisConnectionError, RedisTimeoutError):
        with _client_lock:
            if state.rollout_client is client:
                state.rollout_client = None
        with suppress(RedisError, OSError):
            client.close()
        raise
    state.redis_outage.answered()


ClientDep = Annotated[RolloutClient, Depends(get_client)]

_bearer = HTTPBearer(auto_error=False, description="Required when the API has a token")


async def require_token(settings: SettingsDep,
                        creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    """Mutating endpoints: with a token configured, `Authorization: Bearer <token>` must match."""
    if settings.token is None:
        return
    expected = settings.token.get_secret_value()
    if creds is None or not secrets.compare_digest(creds.credentials.encode(), expected.encode()):
        raise ApiError(401, "authorization", "a valid 'Authorization: Bearer <token>' header is "
                       "required for this endpoint", headers={"WWW-Authenticate": "Bearer"})


AuthDep = Depends(require_token)
