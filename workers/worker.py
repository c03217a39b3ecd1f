"""The GPU worker's loop: pull admitted sessions, run them concurrently, heartbeat, finish.

Asyncio tasks around one `WorkerLink` and one shared `httpx.AsyncClient`, and one thread:
- pull: `read_admitted` (our backlog first, then new entries), `mark_running_many`, and one task
  per session running `SessionRunner.run`;
- heartbeat: about once a second, scrape the engine's /metrics and send it with every running
  session's progress. An engine that does not answer gets no heartbeat: the key expires after
  its TTL, so the broker stops admitting here and requeues what was here;
- finish: publishes finished sessions in batches (`finish_many`: result + ledger release + ack).
Blocking Redis calls run on a small thread pool of their own, so a blocked read never delays a
heartbeat.

Drain (SIGTERM): stop pulling, let running sessions finish for `drain_grace_s`, cancel the rest,
then `withdraw`: the broker requeues every session still admitted here (run or not) at once.
SIGKILL loses nothing either: the heartbeat lapses and the broker reclaims the same way.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from broker.heartbeat import DEFAULT_HEARTBEAT_TTL_S
from broker.worker_link import AdmittedSession, BackendReclaimed, CompletionStats, WorkerLink
from broker.session import SessionResult
from workers.engine import EngineInfo, EngineScrape, parse_metrics, read_engine_info
from workers.runner import Progress, RunnerSettings, SessionRunner
from workers.tools import ToolExecutor

log = logging.getLogger("rollout_broker.worker")


@dataclass(slots=True)
class WorkerSettings:
    backend_id: str
    redis_url: str
    namespace: str = "default"
    heartbeat_s: float = 1.0
    heartbeat_ttl_s: float = DEFAULT_HEARTBEAT_TTL_S
    read_count: int = 256  # admitted entries per read
    read_block_ms: int = 250  # also bounds how long a drain waits for the pull loop to notice
    drain_grace_s: float = 30.0
    engine_down_after_s: float = 10.0  # no /metrics answer for this long: the engine is down
    max_connections: int = 1024  # HTTP connections to the engine (one per running turn)
    runner: RunnerSettings = field(default_factory=RunnerSettings)


@dataclass(slots=True)
class WorkerCounters:
    started: int = 0
    finished: int = 0  # results published ('ok')
    refused: int = 0  # finish replies other than 'ok' (requeued elsewhere, cancelled)
    failed: int = 0  # published with status failed
    handed_back: int = 0  # cancelled by a drain and withdrawn


class Worker:
    def __init__(self, settings: WorkerSettings, engine_url: str, tools: ToolExecutor) -> None:
        self.settings = settings
        self.engine_url = engine_url.rstrip("/")
        self.tools = tools
        self.link = WorkerLink(settings.redis_url, settings.namespace, settings.backend_id,
                               heartbeat_ttl_s=settings.heartbeat_ttl_s)
        self.counters = WorkerCounters()
        self.engine_healthy = True
        self.info: EngineInfo | None = None
        self._io = ThreadPoolExecutor(max_workers=8, thread_name_prefix="redis")
        self._running: dict[str, tuple[asyncio.Task, Progress]] = {}
        self._scrape_ok: EngineScrape | None = None  # the latest successful /metrics read
        self._scraped_at = 0.0  # monotonic time of that read
        self._scrape_error = ""
        self._finished: asyncio.Queue[tuple[SessionResult, CompletionStats]] = asyncio.Queue()

    async def _redis(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    # -- lifecycle ------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then drain. Returns when everything is published or
        handed back."""
        s = self.settings
        self.info = await asyncio.to_thread(read_engine_info, self.engine_url)
        await self._register()
        limits = httpx.Limits(max_connections=s.max_connections,
                              max_keepalive_connections=min(256, s.max_connections))
        timeout = httpx.Timeout(s.runner.request_timeout_s, pool=None)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
            runner = SessionRunner(http, self.engine_url, self.info.model,
                                   self.info.max_model_len, self.tools, s.runner)
            await self._scrape_once(http)
            scraper = asyncio.create_task(self._scrape_loop(http), name="scrape")
            beats_done = threading.Event()
            beats = threading.Thread(target=self._beat_thread, args=(beats_done,),
                                     name=f"heartbeat-{s.backend_id}", daemon=True)
            beats.start()
            finisher = asyncio.create_task(self._finish_loop(), name="finish")
            try:
                await self._pull_loop(runner, stop)
                await self._drain()
            finally:
                beats_done.set()
                await asyncio.to_thread(beats.join)
                scraper.cancel()
                await asyncio.gather(scraper, return_exceptions=True)
                await self._finished.join()
                finisher.cancel()
                await asyncio.gather(finisher, return_exceptions=True)
                await self._redis(self.link.withdraw)
                self._io.shutdown(wait=True)
                self.link.close()
        log.info("worker %s: stopped (%s)", s.backend_id, self.counters)

    async def _register(self) -> None:
        assert self.info is not None
        await self._redis(self.link.register, self.info.capacity_tokens, self.info.max_model_len)
        log.info("worker %s: registered, capacity %d tokens, max_model_len %d",
                 self.settings.backend_id, self.info.capacity_tokens, self.info.max_model_len)

    async def _drain(self) -> None:
        tasks = [t for t, _ in self._running.values()]
        if tasks:
            log.info("worker %s: draining %d sessions (grace %.0fs)", self.settings.backend_id,
                     len(tasks), self.settings.drain_grace_s)
            _, late = await asyncio.wait(tasks, timeout=self.settings.drain_grace_s)
            for t in late:
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)
            self.counters.handed_back += len(late)

    # -- pulling and running --------------------------------------------------------------------
    async def _pull_loop(self, runner: SessionRunner, stop: asyncio.Event) -> None:
        s = self.settings
        while not stop.is_set():
            if not self.engine_healthy:  # admit nothing while the engine is down
                await asyncio.sleep(0.2)
                continue
            try:
                fresh: list[AdmittedSession] = await self._redis(
                    self.link.read_admitted, s.read_count, s.read_block_ms)
            except BackendReclaimed:
                # Our heartbeat lapsed and the broker requeued our sessions: anything we still
                # run would be refused at finish, so stop it and start over.
                log.warning("worker %s: reclaimed by the broker; registering again", s.backend_id)
                tasks = [t for t, _ in self._running.values()]
                for task in tasks:
                    task.cancel()
                # Wait until they are gone, or a re-admitted session would look "running".
                await asyncio.gather(*tasks, return_exceptions=True)
                await self._register()
                continue
            if stop.is_set():
                break  # read after the stop: leave them admitted; the withdraw hands them back
            fresh = [a for a in fresh if a.session.session_id not in self._running]
            if not fresh:
                continue
            ok = await self._redis(self.link.mark_running_many,
                                   [a.session.session_id for a in fresh])
            for a, run in zip(fresh, ok):
                if run:
                    self._start(runner, a)

    def _start(self, runner: SessionRunner, a: AdmittedSession) -> None:
        sid = a.session.session_id
        progress = Progress(sid, context_tokens=a.session.prompt_len_hint)
        task = asyncio.create_task(self._run_one(runner, a, progress), name=f"session-{sid}")
        self._running[sid] = (task, progress)
        self.counters.started += 1

    async def _run_one(self, runner: SessionRunner, a: AdmittedSession, progress: Progress) -> None:
        try:
            out = await runner.run(a.session, progress)
            await self._finished.put((out.result, out.stats))
        except Exception:  # a bug, not an engine or tool failure: log it, keep the others going
            log.exception("worker %s: session %s crashed", self.settings.backend_id,
                          a.session.session_id)
        finally:
            self._running.pop(a.session.session_id, None)

    async def _finish_loop(self) -> None:
        while True:
            batch = [await self._finished.get()]
            while not self._finished.empty() and len(batch) < 200:
                batch.append(self._finished.get_nowait())
            try:
                replies = await self._redis(self.link.finish_many, batch)
                for (result, _), reply in zip(batch, replies):
                    if reply == "ok":
                        self.counters.finished += 1
                        self.counters.failed += result.status == "failed"
                    else:
                        self.counters.refused += 1
                        log.info("session %s: finish said %s; dropped", result.session_id, reply)
            except Exception:
                log.exception("worker %s: finishing %d sessions failed", self.settings.backend_id,
                              len(batch))
            finally:
                for _ in batch:
                    self._finished.task_done()

    # -- heartbeats -----------------------------------------------------------------------------
    def _beat_thread(self, done: threading.Event) -> None:
        """Beat every `heartbeat_s` with the latest /metrics scrape, from a thread of its own:
        a busy event loop (hundreds of sessions starting at once) delays the numbers, never the
        beat. Only an engine whose /metrics has not answered for `engine_down_after_s` stops
        the beats, and with them admissions here."""
        s = self.settings
        while True:
            self._beat_once()
            if done.wait(s.heartbeat_s):
                return

    def _beat_once(self) -> None:
        s = self.settings
        age = time.monotonic() - self._scraped_at
        healthy = self._scrape_ok is not None and age <= s.engine_down_after_s
        if healthy != self.engine_healthy:
            if healthy:
                log.warning("worker %s: engine answers again", s.backend_id)
            else:
                log.error("worker %s: engine /metrics has not answered for %.1fs (%s); "
                          "heartbeats stop until it does", s.backend_id, age, self._scrape_error)
        self.engine_healthy = healthy
        if not healthy:
            return
        progress = [p.snapshot() for _, p in list(self._running.values())]
        try:
            self.link.heartbeat(self._scrape_ok.metrics, progress)
        except RuntimeError:  # not registered: the pull loop's next reclaim registers
            log.warning("worker %s: heartbeat refused: not registered", s.backend_id)
        except Exception:
            log.exception("worker %s: heartbeat failed", s.backend_id)

    async def _scrape_once(self, http: httpx.AsyncClient) -> None:
        try:
            r = await http.get(f"{self.engine_url}/metrics",
                               timeout=self.settings.engine_down_after_s)
            r.raise_for_status()
            self._scrape_ok = parse_metrics(r.text)
            self._scraped_at = time.monotonic()
        except (httpx.HTTPError, ValueError) as exc:
            self._scrape_error = f"{type(exc).__name__}: {exc}"

    async def _scrape_loop(self, http: httpx.AsyncClient) -> None:
        while True:
            started = time.monotonic()
            await self._scrape_once(http)
            await asyncio.sleep(max(0.0, self.settings.heartbeat_s - (time.monotonic() - started)))
