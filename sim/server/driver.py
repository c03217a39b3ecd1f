"""Wall-clock driver: one asyncio task steps the engine core on a scaled clock.

virtual = (wall − wall0) × time_scale. The task calls `core.advance(until=virtual_now)` every
`tick_s` wall seconds while work is pending (and sleeps until woken when idle); a request that the
core reports finished is released to its caller once the virtual clock reaches its
`finish_time`, so latency seen over HTTP matches the simulated step times.

The core is single-threaded and not thread-safe: it is touched only from the event loop thread
(this task, `submit`, `abort`, `pause`, `resume` and `stats` are all called on the loop).

Pause and resume follow vLLM's API for weight updates in RL (`POST /pause?mode=`, `/resume`):
`abort` aborts everything in flight (each caller gets its partial output, finish reason
"abort"), `wait` lets it finish, `keep` freezes it where it is; the first two then drop the
prefix cache unless told not to (the weights it was computed with are about to change). While
paused the engine's clock stands still and new requests wait, to start on resume. As in vLLM,
the weights carry a label (`update_weight_version`, "default" until set) and every request keeps
which label generated which span of its output (`/inference/v1/generate`'s `weight_versions`).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable

from sim.engine.core import EngineCore, EngineStats
from sim.engine.request import EngineRequest


class EngineDriver:
    def __init__(self, core: EngineCore, time_scale: float = 1.0, tick_s: float = 0.002,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale: must be > 0, got {time_scale}")
        self.core = core
        self.time_scale = time_scale
        self.tick_s = tick_s
        self._clock = clock
        self._wall0 = clock()
        self._virtual0 = core.now
        self._futures: dict[str, asyncio.Future[EngineRequest]] = {}
        # (finish_time, seq, request): finished in the core, not yet due on the virtual clock.
        self._due: list[tuple[float, int, EngineRequest]] = []
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._paused = False
        self._frozen_at: float | None = None  # wall time the clock stopped (paused)
        self._held: list[EngineRequest] = []  # submitted while paused: start on resume
        self.weight_version = "default"  # vLLM's label before any update_weight_version

    def virtual_now(self) -> float:
        wall = self._clock() if self._frozen_at is None else self._frozen_at
        return self._virtual0 + (wall - self._wall0) * self.time_scale

    @property
    def paused(self) -> bool:
        return self._paused

    async def pause(self, mode: str, clear_cache: bool = True) -> None:
        """Pause generation (see the module docstring); returns once it is paused. A second
        pause while paused does nothing, as in vLLM."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"mode: must be abort, wait or keep, got {mode!r}")
        if self._paused:
            return
        self._paused = True
        if mode == "abort":
            self._catch_up()
            self.core.abort_all()
            self._wake.set()
        if mode != "keep":
            while self.core.has_unfinished() or self._due:
                await asyncio.sleep(self.tick_s)
            if clear_cache:
                self.core.reset_prefix_cache()
        self._catch_up()
        self.core.settle(self.virtual_now())
        self._catch_up()
        self._frozen_at = self._clock()

    def resume(self) -> None:
        """Restart the clock where it stopped and start what was submitted meanwhile."""
        if not self._paused:
            return
        if self._frozen_at is not None:
            self._wall0 += self._clock() - self._frozen_at
            self._frozen_at = None
        self._paused = False
        held, self._held = self._held, []
        now = max(self.core.now, self.virtual_now())
        for request in held:
            request.arrival_time = now
            self.core.add_request(request)
        self._wake.set()

    def set_weight_version(self, label: str) -> None:
        """vLLM's `update_weight_version`: output tokens generated from now on carry `label`
        (each request keeps where its spans of labels start)."""
        self._catch_up()
        self.weight_version = label
        for req in itertools.chain(self.core.requests.values(), self._held):
            starts = req.weight_version_starts
            if starts is not None and starts[-1][0] != label:
                starts.append((label, req.num_output_tokens))

    def start(self) -> None:
        assert self._task is None, "driver already started"
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-driver")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for fut in self._futures.values():
            if not fut.done():
                fut.cancel()
        self._futures.clear()

    def submit(self, request: EngineRequest) -> asyncio.Future[EngineRequest]:
        """Add `request` at the current virtual time; the future resolves when it finishes.

        Raises ValueError("<field>: reason") from the core on bad input, before anything runs.
        """
        assert request.request_id not in self._futures, f"duplicate request id {request.request_id}"
        request.weight_version_starts = [(self.weight_version, 0)]
        if self._paused:
            self.core.validate(request)
            self._held.append(request)
        else:
            self._catch_up()
            request.arrival_time = max(self.core.now, self.virtual_now())
            self.core.add_request(request)
        fut: asyncio.Future[EngineRequest] = asyncio.get_running_loop().create_future()
        self._futures[request.request_id] = fut
        self._wake.set()
        return fut

    def abort(self, request_id: str) -> None:
        """Drop a request whose client went away; its future is cancelled."""
        self._held = [r for r in self._held if r.request_id != request_id]
        self.core.abort_request(request_id)
        fut = self._futures.pop(request_id, None)
        if fut is not None and not fut.done():
            fut.cancel()

    def stats(self) -> EngineStats:
        self._catch_up()
        return self.core.stats()

    def _catch_up(self) -> None:
        """Advance the core to the virtual present and queue what finished."""
        now = self.virtual_now()
        if now > self.core.now:
            for req in self.core.advance(until=now):
                finish = req.finish_time if req.finish_time is not None else now
                heapq.heappush(self._due, (finish, next(self._seq), req))
        self._release(now)

    def _release(self, now: float) -> None:
        while self._due and self._due[0][0] <= now:
            _, _, req = heapq.heappop(self._due)
            fut = self._futures.pop(req.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(req)

    async def _run(self) -> None:
        while True:
            self._catch_up()
            if self._frozen_at is not None:
                await self._wake.wait()  # paused: nothing moves until resume
            elif self.core.has_unfinished() or self._due:
                timeout = self.tick_s
                if self._due and not self.core.has_unfinished():
                    wall_left = (self._due[0][0] - self.virtual_now()) / self.time_scale
                    timeout = max(wall_left, 0.0)
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=timeout)
                except TimeoutError:
                    pass
            else:
                await self._wake.wait()
            self._wake.clear()
