"""delete_namespace: one namespace's keys go, everyone else's stay (real Redis)."""

from __future__ import annotations

import pytest

from broker.keys import Keys
from broker.redis_conn import delete_namespace

pytestmark = pytest.mark.redis


def test_only_the_namespaces_keys_are_deleted(redis_client, namespace):
    mine, other = Keys(namespace), Keys(namespace + "x")
    for i in range(25):
        redis_client.set(f"{mine.prefix}k{i}", 1)
    redis_client.hset(mine.weights, "epoch", 1)
    redis_client.set(f"{other.prefix}k", 1)
    redis_client.set(f"unrelated-{namespace}", 1)
    try:
        assert delete_namespace(redis_client, mine.prefix, batch=10) == 26
        assert not list(redis_client.scan_iter(match=f"{mine.prefix}*"))
        assert redis_client.exists(f"{other.prefix}k", f"unrelated-{namespace}") == 2
    finally:
        redis_client.delete(f"{other.prefix}k", f"unrelated-{namespace}")


def test_a_prefix_that_is_not_a_namespace_is_refused_naming_it(redis_client):
    with pytest.raises(ValueError, match="prefix"):
        delete_namespace(redis_client, "rb:")
