"""`rollout-broker worker`: open the engine, run the worker until SIGTERM/SIGINT, stop the engine.

A worker whose engine serves several namespaces (`--namespace 'jobA=0.6,jobB=0.4'`,
broker/shares.py) runs one `Worker` per namespace in this process, over the one engine, each
with its own tool executor; they share the engine's LoRA adapter cache and an
`EngineTenancy` (workers/tenancy.py).

The first SIGTERM or SIGINT drains (see `workers.worker`); a second one during the drain cuts
the grace short. The engine child, if we started one, is stopped in `finally`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass, replace

from broker.redis_conn import check_redis_url
from broker.shares import shares_of
from sim.engine.profiles import check_engine_options, get_profile
from workers.engine import (
    NO_VLLM,
    check_gpu_count,
    EngineIncompatible,
    EngineSpec,
    installed_vllm,
    open_engine,
    read_engine_info,
    vllm_command,
)
from workers.adapters import EngineAdapters
from workers.tenancy import EngineTenancy
from workers.tools import load_registry, make_executor, tools_redis_url
from workers.worker import SHARED_ENGINE_HOOK, Worker, WorkerSettings, load_weights_hook

log = logging.getLogger("rollout_broker.worker")


@dataclass(slots=True)
class EngineOptions:
    spec: str  # attach:URL | vllm:MODEL [ARGS] | sim:PROFILE
    time_scale: float = 1.0  # sim engines, and simulated tool latencies
    kv_tokens: int | None = None  # sim engines: override the profile's KV capacity
    seed: int = 0
    ready_timeout_s: float = 600.0  # vLLM loads weights and captures graphs before /health
    weights_hook: str | None = None  # 'package.module:function' loading a version's weights
    # A child engine's address: loopback, or 0.0.0.0 with a fixed port for a session gateway
    # on another host or container (then the worker's advertise_url names where it is).
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port


@dataclass(slots=True)
class ToolOptions:
    kind: str = "inline"  # inline | rq
    timeout_s: float = 60.0
    retries: int = 1  # rq only
    config: str | None = None  # the operator's TOML registry (inline; rq: the tool workers')
    redis_url: str | None = None  # rq: the tool queues' Redis (default: the worker's own)


async def _serve(workers: list[Worker]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():  # second signal: no more grace
            for w in workers:
                w.settings.drain_grace_s = 0.0
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        await asyncio.gather(*(w.run(stop) for w in workers))
    finally:
        for w in workers:
            await w.tools.aclose()


class WorkerConfigError(ValueError):
    """An option that cannot work, or an engine without what the worker needs, named; raised
    before the worker serves (and before anything starts, for an option)."""


def run_worker(settings: WorkerSettings, engine: EngineOptions, tools: ToolOptions,
               tenants: Mapping[str, float] | None = None) -> None:
    """Check the options (`WorkerConfigError` naming the bad one, before anything starts), open
    the engine and check it (`WorkerConfigError` naming what it lacks: `read_engine_info`),
    serve until a signal, close the engine. SystemExit (status 1, saying why) when the worker
    stopped by itself: its weights hook failed. `tenants`: the namespaces the engine serves
    and their guaranteed shares (`broker.shares.parse_tenants`; default: `settings.namespace`
    alone)."""
    tenancy = EngineTenancy(tenants or {settings.namespace: 1.0})
    try:
        check_redis_url(settings.redis_url)
        spec = EngineSpec.parse(engine.spec)
        check_engine_options(engine.time_scale, engine.kv_tokens)
        if spec.kind == "sim":
            try:
                get_profile(spec.target)
            except ValueError as exc:
                raise ValueError(f"engine: sim: {exc}") from None
        loopback = engine.host in ("127.0.0.1", "localhost", "::1")
        if spec.kind == "attach" and (not loopback or engine.port):
            raise ValueError("engine_host: an attached engine listens where it was started; "
                             "--engine-host and --engine-port are for engines the worker starts")
        if not 0 <= engine.port <= 65535:
            raise ValueError(f"engine_port: {engine.port} is not a TCP port")
        if not loopback and not (engine.port and settings.advertise_url):
            raise ValueError(f"advertise_url: an engine bound to {engine.host} is for a session "
                             "gateway elsewhere: give --engine-port and --advertise-url (the URL "
                             "the gateway reaches it at)")
        if spec.kind == "attach" and not spec.target.startswith(("http://", "https://")):
            raise ValueError(f"engine: attach:{spec.target} must name an http:// or https:// URL")
        if spec.kind == "vllm":
            vllm_command(spec.target, 0, spec.args)  # refuses --host/--port in the args
            install = installed_vllm()
            if install is None:
                raise ValueError(NO_VLLM)
            if not install.cpu_build:  # the container's GPUs against the parallel sizes
                check_gpu_count(spec.args, os.environ)
        hook = load_weights_hook(engine.weights_hook)
        if hook is not None and tenancy.shared:
            raise ValueError(SHARED_ENGINE_HOOK)
        if tools.kind not in ("inline", "rq"):
            raise ValueError(f"tools: {tools.kind!r} must be 'inline' or 'rq'")
        # With rq the tool workers' registry is the one that counts; theirs is loaded there.
        registry = load_registry(tools.config) if tools.kind == "inline" else None
        tools_url = tools_redis_url(settings.redis_url, tools.redis_url) \
            if tools.kind == "rq" else settings.redis_url
    except ValueError as exc:
        raise WorkerConfigError(str(exc)) from None
    settings.runner.time_scale = engine.time_scale
    handle = open_engine(spec, time_scale=engine.time_scale, kv_tokens=engine.kv_tokens,
                         seed=engine.seed, ready_timeout_s=engine.ready_timeout_s,
                         host=engine.host, port=engine.port or None)
    try:
        log.info("worker %s: engine at %s", settings.backend_id, handle.url)
        try:
            info = read_engine_info(handle.url, weight_reload=hook is not None)
        except EngineIncompatible as exc:
            raise WorkerConfigError(str(exc)) from None
        log.info("worker %s: engine serves %s (vLLM %s): max_model_len %d, vocabulary %s",
                 settings.backend_id, info.model, info.version, info.max_model_len,
                 info.vocab_size)
        adapters = EngineAdapters(settings.lora_cache or info.max_loras) \
            if info.max_loras else None
        workers = [Worker(replace(settings, namespace=ns), handle.url,
                          make_executor(tools.kind, tools_url, ns, tools.timeout_s,
                                        tools.retries, registry),
                          hook, info, tenancy, adapters)
                   for ns in tenancy.shares]
        if tenancy.shared:
            log.info("worker %s: the engine serves namespaces %s", settings.backend_id,
                     shares_of(tenancy.shares))
        asyncio.run(_serve(workers))
    finally:
        handle.close()
    failures = [w.failure for w in workers if w.failure]
    if failures:  # it stopped by itself, its sessions handed back: say why, exit 1
        raise SystemExit(f"worker {settings.backend_id}: {failures[0]}")
