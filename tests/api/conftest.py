"""API fixtures: the app on a fresh namespace of the real test Redis, a live fleet (broker
thread with a baseline policy + simulated backends), and uvicorn on loopback for a browser."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import uvicorn
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import ApiSettings
from sim.backend import SimulatedBackend
from broker.policies import make_policy
from broker.redis_server import free_port
from tests.broker.helpers import BrokerThread


@pytest.fixture
def settings(redis_url: str, namespace: str) -> ApiSettings:
    return ApiSettings(redis_url=redis_url, namespace=namespace)


@pytest.fixture
def api(settings: ApiSettings, redis_client) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as client:
        yield client


class Fleet:
    """Simulated backends and one broker thread on the test's namespace."""

    def __init__(self, redis_url: str, namespace: str) -> None:
        self.redis_url = redis_url
        self.namespace = namespace
        self.backends: list[SimulatedBackend] = []
        self.broker: BrokerThread | None = None

    def backend(self, backend_id: str, capacity: int = 4000, **kw) -> SimulatedBackend:
        b = SimulatedBackend(self.redis_url, self.namespace, backend_id, capacity,
                             heartbeat_s=0.1, **kw).start()
        self.backends.append(b)
        return b

    def start_broker(self, policy: str = "least_loaded") -> BrokerThread:
        self.broker = BrokerThread(self.redis_url, self.namespace, policy=make_policy(policy),
                                   lease_s=1.0).start()
        return self.broker

    def stop(self) -> None:
        if self.broker is not None:
            self.broker.stop()
        for b in self.backends:
            b.stop()


@pytest.fixture
def fleet(redis_url: str, namespace: str, redis_client) -> Iterator[Fleet]:
    f = Fleet(redis_url, namespace)
    yield f
    f.stop()


@pytest.fixture
def live_server(settings: ApiSettings, redis_client) -> Iterator[Callable[[], str]]:
    """Start uvicorn on a free loopback port on first call; returns the base URL."""
    started: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start() -> str:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port,
                                               log_level="warning", lifespan="on"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 15
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        started.append((server, thread))
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in started:
        server.should_exit = True
        thread.join(timeout=10)
