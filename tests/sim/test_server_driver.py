"""The wall-clock driver maps wall time to virtual time and releases requests when they are due."""

from __future__ import annotations

import asyncio

from sim.engine.core import EngineCore
from sim.engine.profiles import get_profile
from sim.engine.request import EngineRequest
from sim.server.driver import EngineDriver


class FakeWall:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_virtual_time_is_scaled_wall_time_and_futures_wait_for_finish_time() -> None:
    async def scenario() -> None:
        wall = FakeWall()
        core = EngineCore(get_profile("h100-8b"), seed=0)
        driver = EngineDriver(core, time_scale=10.0, tick_s=0.001, clock=wall)
        driver.start()
        try:
            wall.t += 0.5  # 5 virtual seconds pass while idle
            req = EngineRequest("r1", list(range(1000, 1100)), max_tokens=50, output_len=50)
            fut = driver.submit(req)
            assert req.arrival_time == 5.0
            await asyncio.sleep(0.02)
            assert not fut.done()  # the wall clock is frozen, so no virtual time passes
            wall.t += 0.001  # 10 virtual ms: a few steps at most, not 50 decodes
            await asyncio.sleep(0.02)
            assert not fut.done()
            wall.t += 100.0
            done = await asyncio.wait_for(fut, timeout=5)
            assert done.finished and len(done.output_token_ids) == 50
            assert done.finish_time is not None and 5.0 < done.finish_time <= driver.virtual_now()
        finally:
            await driver.stop()

    asyncio.run(scenario())


def test_abort_cancels_the_future() -> None:
    async def scenario() -> None:
        wall = FakeWall()
        driver = EngineDriver(EngineCore(get_profile("h100-8b")), clock=wall)
        driver.start()
        try:
            fut = driver.submit(EngineRequest("r1", [1000] * 40, max_tokens=10, output_len=10))
            driver.abort("r1")
            assert fut.cancelled()
            wall.t += 1.0
            await asyncio.sleep(0.02)
            assert not driver.core.has_unfinished()
        finally:
            await driver.stop()

    asyncio.run(scenario())
