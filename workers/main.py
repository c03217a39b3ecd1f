"""`rollout-broker worker`: open the engine, run the worker until SIGTERM/SIGINT, stop the engine.

The first SIGTERM or SIGINT drains (see `workers.worker`); a second one during the drain cuts
the grace short. The engine child, if we started one, is stopped in `finally`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

from workers.engine import EngineSpec, open_engine
from workers.tools import make_executor
from workers.worker import Worker, WorkerSettings

log = logging.getLogger("rollout_broker.worker")


@dataclass(slots=True)
class EngineOptions:
    spec: str  # attach:URL | vllm:MODEL [ARGS] | sim:PROFILE
    time_scale: float = 1.0  # sim engines, and simulated tool latencies
    kv_tokens: int | None = None  # sim engines: override the profile's KV capacity
    seed: int = 0
    ready_timeout_s: float = 600.0  # vLLM loads weights and captures graphs before /health


@dataclass(slots=True)
class ToolOptions:
    kind: str = "inline"  # inline | rq
    timeout_s: float = 60.0
    retries: int = 1  # rq only


async def _serve(worker: Worker) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():  # second signal: no more grace
            worker.settings.drain_grace_s = 0.0
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        await worker.run(stop)
    finally:
        await worker.tools.aclose()


def run_worker(settings: WorkerSettings, engine: EngineOptions, tools: ToolOptions) -> None:
    spec = EngineSpec.parse(engine.spec)
    settings.runner.time_scale = engine.time_scale
    handle = open_engine(spec, time_scale=engine.time_scale, kv_tokens=engine.kv_tokens,
                         seed=engine.seed, ready_timeout_s=engine.ready_timeout_s)
    try:
        log.info("worker %s: engine at %s", settings.backend_id, handle.url)
        executor = make_executor(tools.kind, settings.redis_url, tools.timeout_s, tools.retries)
        asyncio.run(_serve(Worker(settings, handle.url, executor)))
    finally:
        handle.close()
