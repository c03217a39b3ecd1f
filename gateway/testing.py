"""Run the session gateway in-process on a free loopback port (tests, benchmarks, examples).

    with running_gateway(redis_url, namespace) as gw:
        openai.OpenAI(base_url=f"{gw.url}/sessions/ep-1/v1", api_key="-")
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from gateway.app import create_app
from gateway.service import Gateway, GatewaySettings
from sim.server.testing import serving


@dataclass(frozen=True, slots=True)
class RunningGateway:
    url: str
    gateway: Gateway


@contextmanager
def running_gateway(redis_url: str, namespace: str, host: str = "127.0.0.1",
                    **settings) -> Iterator[RunningGateway]:
    app = create_app(GatewaySettings(redis_url=redis_url, namespace=namespace, **settings))
    with serving(app, host, "gateway") as port:
        yield RunningGateway(url=f"http://{host}:{port}", gateway=app.state.gateway)
