"""Health probes for processes that serve no HTTP (compose healthchecks, Kubernetes exec
probes): `rollout-broker probe broker|worker|tools` exits 0 when the role is doing its job, else
1 with one line saying why. Each reads what the process itself keeps fresh in Redis."""

from __future__ import annotations

import socket
from datetime import datetime, timezone

import redis

from broker.keys import Keys


def probe_broker(client: redis.Redis, keys: Keys) -> str | None:
    """A broker holds the namespace's lease (it renews it every third of the period)."""
    if not client.exists(keys.lease):
        return f"broker: no broker holds the lease of namespace {keys.namespace!r}"
    return None


def probe_worker(client: redis.Redis, keys: Keys, backend_id: str) -> str | None:
    """The worker's heartbeat key has not expired (it beats every --heartbeat-s)."""
    if not client.exists(keys.heartbeat(backend_id)):
        return f"worker: backend {backend_id!r} has no live heartbeat"
    return None


def probe_tools(client: redis.Redis, max_age_s: float = 60.0,
                hostname: str | None = None) -> str | None:
    """An RQ tool worker on this host has beaten within `max_age_s` (RQ's own heartbeat)."""
    from rq import Worker

    host = hostname or socket.gethostname()
    now = datetime.now(timezone.utc)
    for w in Worker.all(connection=client):
        beat = w.last_heartbeat
        if w.hostname == host and beat is not None:
            if beat.tzinfo is None:
                beat = beat.replace(tzinfo=timezone.utc)
            if (now - beat).total_seconds() <= max_age_s:
                return None
    return f"tools: no RQ tool worker on {host} has beaten in the last {max_age_s:g}s"
