"""Shared fixtures. Tests that need Redis talk to a real server: $REDIS_URL, or one we start."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from hypothesis import HealthCheck, settings

# A shared 2-core CI box can be slow to generate examples; that is not a failure of the code
# under test. Deadlines are off for the same reason (speed is checked by benchmarks).
settings.register_profile("rollout-broker", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("rollout-broker")

from broker.redis_server import RedisHandle, ensure_redis


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisHandle]:
    handle = ensure_redis()
    yield handle
    handle.close()


@pytest.fixture
def redis_url(redis_server: RedisHandle) -> str:
    return redis_server.url


@pytest.fixture
def namespace() -> str:
    """A fresh namespace per test, so tests never see each other's keys."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def redis_client(redis_url: str, namespace: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=False)
    yield client
    for key in client.scan_iter(match=f"rb:{{{namespace}}}:*", count=1000):
        client.delete(key)
    client.close()
