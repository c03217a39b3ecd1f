"""Shared helpers for the worker tests: a Worker on its own event loop in a thread, sessions."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

import httpx

from broker.session import Session
from workers.adapters import EngineAdapters
from workers.engine import parse_metrics, read_engine_info
from workers.runner import RunnerSettings
from workers.tenancy import EngineTenancy
from workers.tools import InlineExecutor, ToolRegistry
from workers.worker import WeightsHook, Worker, WorkerSettings


ROOT = Path(__file__).resolve().parents[2]


def start_worker(redis_url: str, namespace: str, backend_id: str, tool_time_scale: str = "50"
                 ) -> subprocess.Popen:
    """A worker process that starts its own simulated engine (a child in its process group)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "rollout_broker.cli", "worker", "--backend-id", backend_id,
         "--engine", "sim:h100-8b", "--kv-tokens", "40000", "--redis-url", redis_url, "--namespace", namespace,
         "--time-scale", tool_time_scale, "--heartbeat-s", "0.25", "--heartbeat-ttl", "2.0",
         "--drain-grace", "5", "--log-level", "WARNING"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True)


def terminate_workers(procs: Mapping[str, subprocess.Popen]) -> None:
    """SIGTERM the workers still running and wait for them to drain."""
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
            p.wait(timeout=60)


def kill_process_groups(procs: Mapping[str, subprocess.Popen]) -> None:
    """SIGKILL what is left of each worker's process group (an engine child that outlived it)."""
    for p in procs.values():
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class WorkerThread:
    """One worker on one engine, in a thread of its own; `tenants` (namespace -> guaranteed
    share) makes it serve several namespaces there, as `rollout-broker worker --namespace
    'a=0.6,b=0.4'` does (one `Worker` per namespace, `self.workers`; `self.worker` is the
    first)."""

    def __init__(self, redis_url: str, namespace: str, backend_id: str, engine_url: str,
                 time_scale: float = 200.0, weights_hook: WeightsHook | None = None,
                 registry: ToolRegistry | None = None,
                 tenants: Mapping[str, float] | None = None, **settings) -> None:
        tenancy = EngineTenancy(tenants or {namespace: 1.0})
        info = read_engine_info(engine_url) if tenancy.shared else None
        adapters = EngineAdapters(info.max_loras) if info is not None and info.max_loras \
            else None
        self.workers = [
            Worker(WorkerSettings(backend_id=backend_id, redis_url=redis_url, namespace=ns,
                                  heartbeat_s=0.2, runner=RunnerSettings(time_scale=time_scale),
                                  **settings),
                   engine_url, InlineExecutor(timeout_s=10.0, registry=registry),
                   weights_hook, info, tenancy, adapters)
            for ns in tenancy.shares]
        self.worker = self.workers[0]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._ready.set()
        try:
            await asyncio.gather(*(w.run(self._stop) for w in self.workers))
        finally:
            for w in self.workers:
                await w.tools.aclose()

    def start(self) -> WorkerThread:
        self.thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is not None and self.thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "worker thread did not stop"


def generation_tokens(engine_url: str) -> int:
    return parse_metrics(httpx.get(f"{engine_url}/metrics").text).generation_tokens_total


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 30000 + 1 for i in range(n)]


def mixed_sessions(n_groups: int, prefix: str = "") -> list[Session]:
    """Groups of all three workloads with short outputs; agentic prompts are unique per session
    (so any cache hit they show comes from their own earlier turns)."""
    out: list[Session] = []
    for g in range(n_groups):
        shared = prompt(g, 200)
        for m in range(4):
            out.append(Session(session_id=f"{prefix}rlvr-{g}-{m}", workload="rlvr",
                               group_id=f"{prefix}rlvr-{g}", group_size=4, prompt_token_ids=shared,
                               max_tokens=48))
        for m in range(2):
            out.append(Session(session_id=f"{prefix}rlhf-{g}-{m}", workload="rlhf",
                               group_id=f"{prefix}rlhf-{g}", group_size=2,
                               prompt_token_ids=prompt(1000 + g, 120), max_tokens=32))
        out.append(Session(session_id=f"{prefix}agentic-{g}", workload="agentic",
                           prompt_token_ids=prompt(5000 + g, 300), max_tokens=24, max_turns=3,
                           metadata={"tool": "sim", "reward": "parity", "sim_turns": 3,
                                     "sim_tool_latency_s": "1,1",
                                     "sim_observation_tokens": "40,40"}))
    return out
