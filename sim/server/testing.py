"""Run the real sim-engine server in-process on a free loopback port (tests, workers, the demo).

    with running_engine(profile="h100-8b", time_scale=50) as engine:
        httpx.get(engine.url + "/health")

The socket is bound before the server starts (port 0, so no race for the port), uvicorn serves it
from a daemon thread with its own event loop, and the context exits by asking uvicorn to shut down
and joining the thread.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn

from sim.engine.core import EngineCore
from sim.server.app import EngineSettings, create_app


@dataclass(frozen=True, slots=True)
class RunningEngine:
    host: str
    port: int
    model_name: str
    # The engine itself, for tests that read what it holds (its requests and their KV blocks)
    # rather than what it reports; read-only from other threads.
    core: EngineCore = field(compare=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What the `openai` client takes as `base_url`."""
        return f"{self.url}/v1"


@contextmanager
def running_engine(profile: str = "h100-8b", time_scale: float = 50.0,
                   kv_tokens: int | None = None, seed: int = 0, model_name: str | None = None,
                   host: str = "127.0.0.1", startup_timeout_s: float = 10.0,
                   fault_injection: bool = False, journal: int = 0,
                   max_loras: int = 0, scheduling_policy: str = "fcfs"
                   ) -> Iterator[RunningEngine]:
    settings = EngineSettings(profile=profile, time_scale=time_scale, kv_tokens=kv_tokens,
                              seed=seed, model_name=model_name, fault_injection=fault_injection,
                              journal=journal, max_loras=max_loras,
                              scheduling_policy=scheduling_policy)
    app = create_app(settings)
    with serving(app, host, "sim-engine", startup_timeout_s) as port:
        yield RunningEngine(host=host, port=port, model_name=app.state.sim.model_name,
                            core=app.state.sim.core)


@contextmanager
def serving(app, host: str = "127.0.0.1", name: str = "app",
            startup_timeout_s: float = 10.0) -> Iterator[int]:
    """Serve an ASGI `app` on a free port of `host` from a daemon thread; yields the port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name=f"{name}-{port}", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{name} on port {port} did not start")
            time.sleep(0.01)
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
