"""The FastAPI app: `create_app()` builds it; `serve()` runs it under uvicorn.

Nothing connects at import or at creation: the lifespan makes the async Redis client (which
connects on first command) and the trainer client is made on the first mutating request.
A request body over `max_body_bytes` is refused by `api.limits.BodyLimit` before it is parsed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from api import errors
from api.history import ChartTrail, CounterHistory
from api.limits import BodyLimit
from api.routers import dashboard, health, metrics, mixture, sessions, status, weights
from api.settings import ApiSettings, check_bind, get_settings
from api.status import StatusReader
from broker.keys import Keys
from broker.redis_conn import connect_async


log = logging.getLogger("rollout_broker.api")

CHART_WINDOW_S = 300.0  # the dashboard's charts span this much (api/static/app.js WINDOW_S)
CHART_SAMPLE_S = 2.0  # how often the API samples them when no page is polling
SHUTDOWN_STEP_S = 5.0  # the longest one step of the API's shutdown may take


async def _sample_charts(reader: StatusReader) -> None:
    """Read the status every CHART_SAMPLE_S, so the charts' history exists before a page opens
    (each read feeds the trail); a failed read (Redis down) waits for the next tick."""
    while True:
        try:
            await reader.read()
        except Exception:  # an outage: the status endpoints report it; this waits
            log.debug("chart sample failed", exc_info=True)
        await asyncio.sleep(CHART_SAMPLE_S)


async def _bounded(step: Awaitable, what: str) -> None:
    """A shutdown step that cannot hold the process: past SHUTDOWN_STEP_S it is left behind
    (logged), so SIGTERM always ends the API."""
    try:
        await asyncio.wait_for(step, SHUTDOWN_STEP_S)
    except TimeoutError:
        log.warning("shutdown: %s took over %gs; left behind", what, SHUTDOWN_STEP_S)


def create_app(settings: ApiSettings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.redis = connect_async(settings.redis_url)
        app.state.status_reader = StatusReader(
            app.state.redis, Keys(settings.namespace), app.state.history,
            settings.mixture_window_s, settings.throughput_windows_s)
        app.state.status_reader.trail = app.state.chart_trail
        sampler = asyncio.create_task(_sample_charts(app.state.status_reader),
                                      name="chart-sampler")
        try:
            yield
        finally:
            sampler.cancel()
            await _bounded(asyncio.gather(sampler, return_exceptions=True), "the chart sampler")
            await _bounded(app.state.redis.aclose(), "closing the Redis client")
            if app.state.rollout_client is not None:
                app.state.rollout_client.close()
                app.state.rollout_client = None

    app = FastAPI(title="rollout-broker", version="0.1.0", lifespan=lifespan,
                  summary="Status, metrics and control of a rollout-broker namespace")
    app.state.settings = settings
    app.state.history = CounterHistory(keep_s=max((settings.mixture_window_s,
                                                   *settings.throughput_windows_s)) + 5.0)
    app.state.chart_trail = ChartTrail(keep_s=CHART_WINDOW_S)
    app.state.rollout_client = None
    app.state.redis_outage = errors.RedisOutage()
    app.state.last_status = None  # (StatusPublic, time read): what /metrics shows while Redis is down
    errors.install(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    for r in (status.router, sessions.router, mixture.router, weights.router, metrics.router,
              health.router, dashboard.router):
        app.include_router(r)
    app.mount("/static", StaticFiles(directory=dashboard.STATIC_DIR), name="static")
    return app


def serve(settings: ApiSettings, log_level: str = "info") -> None:
    """Run the API under uvicorn; refuses a non-loopback address without a token."""
    import uvicorn

    check_bind(settings)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=log_level)
