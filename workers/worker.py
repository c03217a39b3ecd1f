"""The GPU worker's loop: pull admitted sessions, run them concurrently, heartbeat, finish.

Asyncio tasks around one `WorkerLink` and one shared engine client (`engine_client`: httpx's API
on aiohttp's pool, workers/engine_http.py), and one thread:
- pull: `read_admitted` (our backlog first, then new entries), `mark_running_many`, and one task
  per session running `SessionRunner.run`;
- heartbeat (a thread): every `heartbeat_s`, the worker's own liveness with every running
  session's progress and the engine's latest /metrics numbers *with the time they were taken*.
  A slow /metrics makes the numbers older, never the beat late. A session stays listed until
  its result is published: the broker requeues a running session the beats stop listing;
- engine watch: GET /health every `heartbeat_s`. A refused connection, or no answer for
  `engine_down_after_s`, opens the circuit: the worker stops pulling, cancels what runs here,
  stops beating and withdraws, so the broker requeues everything admitted here at once and
  admits nothing more. When /health answers again the worker registers and carries on;
- control: follows the namespace's weight-update orders (broker/weights.py) as they are
  written (a blocking read of the `control` stream): on a pause it marks the runner's
  `EngineWeights` paused, pauses the engine with vLLM's `POST /pause?mode=` and acknowledges;
  on a resume it loads a new version's weights with its weights hook, if it has one
  (`--weights-hook`; `_load_weights`; also at start and when the engine comes back), labels
  the engine's weights with the version (vLLM's `POST /update_weight_version`), resumes the
  engine and records the new policy version. The engine says which label generated which
  tokens of every reply, so each output span carries the version that made it, even inside a
  request a `keep` pause froze across the update. A session whose request the pause aborted
  goes on from what it had generated once generation resumes (workers/runner.py). A session
  the trainer cancels while it runs here is stopped, and with it its engine request. An
  adapter-only update (`pause_adapter`/`resume_adapter`) holds that adapter's next sessions
  and pauses the engine only where the adapter is loaded (`_adapter_order`);
- finish: publishes finished sessions in batches (`finish_many`: result + ledger release + ack),
  retrying a batch until Redis takes it. A session the engine could not serve (a broken
  connection, a timeout, 5xx after the retries) is handed back to be run again, an attempt
  counted; only a session's own fault (a 4xx, its tool or reward) ends it `failed`.
Blocking Redis calls run on a small thread pool of their own, so a blocked read never delays a
heartbeat. A Redis outage is ridden out: every loop waits with backoff and carries on by itself
once Redis answers (`broker.redis_conn.Outage`, logged once per outage).

Drain (SIGTERM): stop pulling, say so in the heartbeat (`draining`: the broker admits nothing
more here, so a scale-in sends no new session to a worker on its way out), let running sessions
finish for `drain_grace_s`, then cut the
rest short with the engine's `pause(mode=abort)`: each goes back to the queue with the output it
had generated (`Session.resume_from`), to go on elsewhere; then `withdraw`: the broker requeues
every session still admitted here (run or not) at once.
SIGKILL loses nothing either: the heartbeat lapses and the broker reclaims the same way.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import httpx

from broker import metrics
from broker.completions import CompletionStats
from broker.heartbeat import DEFAULT_HEARTBEAT_TTL_S, SessionProgress
from broker.redis_conn import Outage, is_outage
from broker.session import PartialRollout, Session, SessionResult, SessionState
from broker.worker_link import AdmittedSession, BackendReclaimed, NotRegistered, WorkerLink
from workers.adapters import AdapterLoader, EngineAdapters
from workers.engine import EngineInfo, EngineScrape, parse_metrics, read_engine_info
from workers.engine_http import engine_client
from workers.runner import (
    EngineUnavailable,
    EngineWeights,
    Handoff,
    Progress,
    RunnerSettings,
    SessionRunner,
)
from workers.tenancy import EngineTenancy, Stake
from workers.tools import ToolExecutor, ToolUnavailable, describe_error, import_callable

log = logging.getLogger("rollout_broker.worker")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class WeightUpdate:
    """What a weights hook is given: load `version`'s weights into the engine at `engine_url`
    (which serves `model`) for backend `backend_id`. The engine is paused while it runs."""

    backend_id: str
    engine_url: str
    model: str
    version: int


WeightsHook = Callable[[WeightUpdate], object]


def load_weights_hook(target: str | None) -> WeightsHook | None:
    """The function `--weights-hook` names ('package.module:function'), or None without one;
    ValueError naming the option when it cannot be imported."""
    if not target:
        return None
    return import_callable(target, "weights-hook")


SHARED_ENGINE_HOOK = ("weights_hook: an engine several namespaces share serves one set of "
                      "weights; jobs sharing it train LoRA adapters (register new adapter "
                      "weights with RolloutClient.register_adapter) instead")


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
    handoff_s: float = 5.0  # after the grace: how long cut sessions get to hand themselves back
    # No /health answer for this long (a hung engine): the engine is down. A refused
    # connection (nothing listens) is down at once. /metrics latency never counts.
    engine_down_after_s: float = 30.0
    health_timeout_s: float = 5.0
    vocab_size: int | None = None  # token ids must be below it; default: what the engine says
    max_connections: int = 1024  # HTTP connections to the engine (one per running turn)
    # The engine's URL as the session gateway reaches it (default: the URL this worker uses,
    # right when they share a host or a network namespace).
    advertise_url: str | None = None
    # LoRA adapters to keep loaded in the engine (0: its --max-loras, vLLM's default CPU cache).
    lora_cache: int = 0
    runner: RunnerSettings = field(default_factory=RunnerSettings)


@dataclass(slots=True)
class WorkerCounters:
    started: int = 0
    finished: int = 0  # results published ('ok')
    refused: int = 0  # finish replies other than 'ok' (another backend has it, cancelled)
    failed: int = 0  # published with status failed
    handed_back: int = 0  # given back to the queue (drain, engine down, engine errors)
    engine_down: int = 0  # times the circuit opened


class Worker:
    def __init__(self, settings: WorkerSettings, engine_url: str, tools: ToolExecutor,
                 weights_hook: WeightsHook | None = None, info: EngineInfo | None = None,
                 tenancy: EngineTenancy | None = None,
                 engine_adapters: EngineAdapters | None = None) -> None:
        """`tenancy` and `engine_adapters`: what this worker shares with the workers of the
        other namespaces its engine serves (workers/tenancy.py); None: it serves one."""
        self.settings = settings
        self.weights_hook = weights_hook
        self.failure: str | None = None  # why the worker stopped by itself (a weights hook)
        self._stop: asyncio.Event | None = None
        self.engine_url = engine_url.rstrip("/")
        self.tools = tools
        self.link = WorkerLink(settings.redis_url, settings.namespace, settings.backend_id,
                               heartbeat_ttl_s=settings.heartbeat_ttl_s)
        self.counters = WorkerCounters()
        self.engine_up = True  # the circuit: closed while the engine serves
        self.info: EngineInfo | None = info  # read (and the engine checked) at start if None
        self.adapters: AdapterLoader | None = None  # the adapters loaded there (LoRA on)
        if tenancy is not None and not tenancy.shared:
            tenancy = None
        if tenancy is not None and weights_hook is not None:
            raise ValueError(SHARED_ENGINE_HOOK)
        self.tenancy = tenancy
        if tenancy is not None:
            tenancy.join(settings.namespace, self._holdings)
        self._engine_adapters = engine_adapters
        self.draining = False  # stopping: its beats say so, and the broker admits nothing more
        self._namespace_paused = False  # a weight update of the namespace holds the engine
        self._engine_paused_for: set[str] = set()  # adapters whose update holds the engine
        self._outage = Outage(f"worker {settings.backend_id}", log)
        self._io = ThreadPoolExecutor(max_workers=8, thread_name_prefix="redis")
        self._running: dict[str, tuple[asyncio.Task, Progress]] = {}
        # Ended here, its result not yet taken by Redis: still `running` there, so still in the
        # beats (the broker requeues a running session its backend's beats stop listing).
        self._finishing: dict[str, Progress] = {}
        self._scrape: EngineScrape | None = None  # the latest successful /metrics read
        self._scraped_at = 0.0  # its wall-clock time: the age the heartbeat carries
        self._health_ok_at = time.monotonic()
        self._registered = threading.Event()  # beats only while registered and engine up
        self._finished: asyncio.Queue[tuple[SessionResult, CompletionStats]] = asyncio.Queue()
        self.weights = EngineWeights()  # what the engine serves; read from Redis at start

    async def _redis(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def _redis_until_ok(self, fn, *args):
        """`fn(*args)` on the Redis pool, waiting out an outage (the call must be idempotent)."""
        while True:
            try:
                out = await self._redis(fn, *args)
            except Exception as exc:
                if not is_outage(exc):
                    raise
                await asyncio.sleep(self._outage.failed(exc))
                continue
            self._outage.ok()
            return out

    async def _unless_stopped(self, work: Awaitable[T]) -> T | None:
        """`work`'s result, or None as soon as `self._stop` is set first (`work` is cancelled:
        a start that waits for Redis or the engine must not outlive a SIGTERM)."""
        task = asyncio.ensure_future(work)
        stopped = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None

    def _close_unstarted(self) -> None:
        """Release what a worker that never served holds (a Redis call still blocked in its
        thread is left to end by itself)."""
        self._io.shutdown(wait=False, cancel_futures=True)
        self.link.close()

    # -- lifecycle ------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then drain. Returns when everything is published or
        handed back, or at once when `stop` is set before the worker has registered (while
        it waits for its engine or for Redis)."""
        s = self.settings
        self._stop = stop
        if self.info is None:
            self.info = await self._unless_stopped(asyncio.to_thread(
                read_engine_info, self.engine_url, weight_reload=self.weights_hook is not None))
        weights = None if self.info is None else \
            await self._unless_stopped(self._redis_until_ok(self.link.weights_state))
        if weights is None:
            log.info("worker %s: stopped before it started", s.backend_id)
            self._close_unstarted()
            return
        # The namespace serves a version already: its weights go in before anything is admitted
        # here. (A pause from now on is in the control stream, read from `control_id`.)
        if weights.version is not None and not await self._load_weights(weights.version):
            self._io.shutdown(wait=True)
            self.link.close()
            return
        await self._unless_stopped(self._register())
        if not self._registered.is_set():
            log.info("worker %s: stopped before it registered", s.backend_id)
            self._close_unstarted()
            return
        self.weights = EngineWeights(weights.version, labelled=self.tenancy is None)
        async with engine_client(s.runner.request_timeout_s, s.max_connections) as http:
            if self.info.max_loras:
                engine = self._engine_adapters or EngineAdapters(s.lora_cache
                                                                 or self.info.max_loras)
                self.adapters = AdapterLoader(
                    http, self.engine_url, partial(self._redis_until_ok, self.link.adapter),
                    engine, self.tenancy.adapter_scope(s.namespace) if self.tenancy else "")
            runner = SessionRunner(http, self.engine_url, self.info.model,
                                   self.info.max_model_len, self.tools, s.runner,
                                   vocab_size=s.vocab_size or self.info.vocab_size,
                                   weights=self.weights, adapters=self.adapters)
            await self._scrape_once(http)
            await self._label_weights(http, weights.version)
            for name in weights.paused_adapters if self.adapters is not None else ():
                self.adapters.pause(name)  # (not loaded here yet: the engine runs on)
            if weights.paused:  # started during a weight update: join it
                self._namespace_paused = True
                await self._pause_engine(http, weights.paused, weights.epoch)
            else:  # an engine a stopped worker left paused (its hook failed) serves again
                await self._resume_if_paused(http)
            watchers = [asyncio.create_task(self._scrape_loop(http), name="scrape"),
                        asyncio.create_task(self._watch_engine(http, stop), name="engine-watch"),
                        asyncio.create_task(self._control_loop(http, weights.control_id),
                                            name="control")]
            beats_done = threading.Event()
            beats = threading.Thread(target=self._beat_thread, args=(beats_done,),
                                     name=f"heartbeat-{s.backend_id}", daemon=True)
            beats.start()
            finisher = asyncio.create_task(self._finish_loop(), name="finish")
            try:
                await self._pull_loop(runner, stop)
                self.draining = True  # from the next beat (sent now) the broker admits no more
                await self._redis(self._beat_once)
                await self._drain(http)
            finally:
                beats_done.set()
                await asyncio.to_thread(beats.join)
                for w in watchers:
                    w.cancel()
                await asyncio.gather(*watchers, return_exceptions=True)
                await self._finished.join()
                finisher.cancel()
                await asyncio.gather(finisher, return_exceptions=True)
                await self._withdraw(deadline_s=10.0)
                self._io.shutdown(wait=True)
                self.link.close()
        log.info("worker %s: stopped (%s)", s.backend_id, self.counters)

    # -- weight updates -------------------------------------------------------------------------
    async def _control_loop(self, http: httpx.AsyncClient, after: str) -> None:
        """Follow the namespace's pause and resume orders (broker/weights.py)."""
        while True:
            try:
                entries = await self._redis(self.link.read_control, after, 1000)
            except Exception as exc:
                if not is_outage(exc):
                    raise
                await asyncio.sleep(self._outage.failed(exc))
                continue
            for entry_id, fields in entries:
                after = entry_id
                if fields.get("adapter"):  # an adapter-only weight update
                    await self._adapter_order(http, fields)
                elif fields.get("op") == "pause":
                    self._namespace_paused = True
                    await self._pause_engine(http, fields.get("mode", "keep"),
                                             int(fields.get("epoch", 0)))
                elif fields.get("op") == "resume":
                    self._namespace_paused = False
                    await self._resume_engine(http, int(fields.get("version", 0)))
                elif (fields.get("op") == "cancel"
                      and fields.get("backend") == self.settings.backend_id):
                    self._stop_cancelled(fields.get("session", ""))

    async def _adapter_order(self, http: httpx.AsyncClient, fields: dict[str, str]) -> None:
        """Pause or resume what serves one LoRA adapter (broker/weights.py). A pause holds the
        adapter's next sessions here and, where the engine has the adapter loaded (and serves
        this namespace alone), pauses the engine; the resume loads the adapter's registered
        weights in place while the engine is still paused, then resumes it unless another
        pause holds it."""
        name, s = fields["adapter"], self.settings
        if fields.get("op") == "pause":
            epoch = int(fields.get("epoch", 0))
            if self.adapters is None:  # LoRA off: nothing of it runs here
                await self._redis_until_ok(self.link.ack_paused, epoch)
                return
            self.adapters.pause(name)
            if self.tenancy is None and self.adapters.serves(name):
                self._engine_paused_for.add(name)
                await self._pause_engine(http, fields.get("mode", "keep"), epoch)
            else:
                await self._redis_until_ok(self.link.ack_paused, epoch)
            log.info("worker %s: adapter %s paused (pause %d%s)", s.backend_id, name, epoch,
                     ", engine paused" if name in self._engine_paused_for else "")
            return
        if self.adapters is None:
            return
        if name in self._engine_paused_for:
            self._engine_paused_for.discard(name)
            try:  # its new weights, before anything generates on the engine again
                await self.adapters.refresh(name)
            except Exception as exc:  # the session that needs it reports it
                log.warning("worker %s: adapter %s: loading its new weights failed (%s)",
                            s.backend_id, name, describe_error(exc))
            if not self._engine_paused_for and not self._namespace_paused:
                await self._engine_call(http, "/resume", {})
                self.weights.resume(self.weights.version)
        self.adapters.resume(name)
        log.info("worker %s: adapter %s resumed", s.backend_id, name)

    def _stop_cancelled(self, session_id: str) -> None:
        """The trainer cancelled a session running here: stop its task. Its HTTP request to
        the engine is dropped, and the engine aborts a request whose client went away (vLLM
        does); no result is published (the session is cancelled)."""
        running = self._running.get(session_id)
        if running is not None:
            running[0].cancel()
            log.info("worker %s: session %s cancelled by the trainer; stopped",
                     self.settings.backend_id, session_id)

    async def _pause_engine(self, http: httpx.AsyncClient, mode: str, epoch: int) -> None:
        """Pause the engine with vLLM's API, then acknowledge; sessions whose requests it
        aborts wait for the resume (workers/runner.py). On an engine other namespaces share,
        the pause is this namespace's own: its next requests wait for the resume, its running
        ones finish (nothing changes the engine's weights), and the engine serves on."""
        if self.tenancy is not None:
            self.weights.pause(epoch, "wait")
            await self._redis_until_ok(self.link.ack_paused, epoch)
            log.info("worker %s: namespace %s paused (pause %d; the engine is shared and "
                     "serves on)", self.settings.backend_id, self.settings.namespace, epoch)
            return
        self.weights.pause(epoch, mode)
        try:
            # `wait` returns once the engine's requests have finished: as long as a turn may take.
            if not await self._engine_call(http, "/pause", {"mode": mode},
                                           self.settings.runner.request_timeout_s):
                log.error("worker %s: pause %d not acknowledged", self.settings.backend_id, epoch)
                return
            await self._redis_until_ok(self.link.ack_paused, epoch)
        finally:
            self.weights.pause_done()
        log.info("worker %s: engine paused (%s, pause %d)", self.settings.backend_id, mode, epoch)

    async def _resume_engine(self, http: httpx.AsyncClient, version: int) -> None:
        if version != self.weights.version and not await self._load_weights(version):
            return  # the engine stays paused; the worker hands its sessions back and stops
        await self._label_weights(http, version)
        if self._engine_paused_for:  # an adapter's update still holds the engine
            self.weights.version = version
            return
        if self.tenancy is None:  # (a shared engine was never paused for this namespace)
            await self._engine_call(http, "/resume", {})
        self.weights.resume(version)
        log.info("worker %s: engine resumed on policy version %d", self.settings.backend_id,
                 version)

    async def _label_weights(self, http: httpx.AsyncClient, version: int | None) -> None:
        """Label the engine's weights with `version` (vLLM's `POST /update_weight_version`)
        before it generates on them: every output span says which weights made it, so a
        request a `keep` pause froze across the update is split where they changed. (Not on
        an engine several namespaces share: its weights never change.)"""
        if self.tenancy is not None:
            return
        try:
            r = await http.post(f"{self.engine_url}/update_weight_version",
                                json={"new_version": EngineWeights.label_for(version)},
                                timeout=self.settings.health_timeout_s)
            r.raise_for_status()
        except httpx.HTTPError as exc:
            log.warning("worker %s: labelling the engine's weights %s failed (%s); tokens it "
                        "generates carry the version their request started on",
                        self.settings.backend_id, version, describe_error(exc))

    async def _load_weights(self, version: int) -> bool:
        """Run the weights hook for `version` while the engine is paused (or not yet serving
        here). If it raises, the worker does not serve on weights it could not load: `failure`
        says why, turns waiting for the resume are handed back with what they had, and the
        worker stops (no grace) and withdraws. True when loaded, or without a hook."""
        if self.weights_hook is None:
            return True
        assert self.info is not None
        b = self.settings.backend_id
        t0 = time.monotonic()
        try:
            await asyncio.to_thread(self.weights_hook,
                                    WeightUpdate(b, self.engine_url, self.info.model, version))
        except Exception as exc:
            self.failure = (f"weights hook: could not load policy version {version}: "
                            f"{describe_error(exc)}")
            log.error("worker %s: %s; handing its sessions back and stopping", b, self.failure)
            self.settings.drain_grace_s = 0.0  # the drain wakes the turns waiting for a resume
            if self._stop is not None:
                self._stop.set()
            return False
        log.info("worker %s: weights of policy version %d loaded (%.1f s)", b, version,
                 time.monotonic() - t0)
        return True

    async def _register(self) -> None:
        assert self.info is not None
        vocab = self.settings.vocab_size or self.info.vocab_size
        await self._redis_until_ok(self.link.register, self.info.capacity_tokens,
                                   self.info.max_model_len, vocab,
                                   self.settings.advertise_url or self.engine_url, self.info.model,
                                   self.info.max_loras)
        self._registered.set()
        log.info("worker %s: registered, capacity %d tokens, max_model_len %d, vocabulary %s, "
                 "LoRA %s", self.settings.backend_id, self.info.capacity_tokens,
                 self.info.max_model_len, vocab or "unknown",
                 f"on (max_loras {self.info.max_loras})" if self.info.max_loras else "off")

    async def _withdraw(self, deadline_s: float) -> None:
        """Hand everything admitted here back (see `WorkerLink.withdraw`); if Redis stays down
        past `deadline_s`, the heartbeat's TTL does the same job."""
        self._registered.clear()
        try:
            await asyncio.wait_for(self._redis_until_ok(self.link.withdraw), deadline_s)
        except TimeoutError:
            log.warning("worker %s: could not withdraw (redis unavailable); the broker "
                        "requeues this backend's sessions when its heartbeat expires",
                        self.settings.backend_id)

    async def _drain(self, http: httpx.AsyncClient) -> None:
        """Let running sessions finish for the grace period; then cut the rest short and hand
        them back with what they had generated: the engine's `pause(mode=abort)` ends their
        requests with their partial output (workers/runner.py `Handoff`); a session still in
        a tool call after `handoff_s` more is cancelled (the broker requeues it on withdraw)."""
        tasks = [t for t, _ in self._running.values()]
        if not tasks:
            return
        log.info("worker %s: draining %d sessions (grace %.0fs)", self.settings.backend_id,
                 len(tasks), self.settings.drain_grace_s)
        _, late = await asyncio.wait(tasks, timeout=self.settings.drain_grace_s)
        if not late:
            return
        self.weights.stop_serving()
        paused = await self._engine_call(http, "/pause", {"mode": "abort"})
        _, stuck = await asyncio.wait(late, timeout=self.settings.handoff_s)
        for t in stuck:
            t.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        if paused and self.failure is None:  # leave the engine serving for whoever is next,
            await self._engine_call(http, "/resume", {})  # unless its weights did not load
        self.counters.handed_back += len(late)

    async def _resume_if_paused(self, http: httpx.AsyncClient) -> None:
        """Resume the engine if it says it is paused (vLLM's `GET /is_paused`); an engine
        without that endpoint, or one that does not answer, is left as it is."""
        try:
            r = await http.get(f"{self.engine_url}/is_paused",
                               timeout=self.settings.health_timeout_s)
            paused = r.status_code == 200 and r.json().get("is_paused") is True
        except (httpx.HTTPError, ValueError, AttributeError):
            return
        if paused:
            log.warning("worker %s: the engine was paused with no weight update under way; "
                        "resuming it", self.settings.backend_id)
            await self._engine_call(http, "/resume", {})

    async def _engine_call(self, http: httpx.AsyncClient, path: str, params: dict,
                           timeout_s: float | None = None) -> bool:
        """POST one of vLLM's control endpoints (/pause, /resume); False (logged) if it fails."""
        try:
            r = await http.post(f"{self.engine_url}{path}", params=params,
                                timeout=timeout_s or self.settings.health_timeout_s)
            r.raise_for_status()
            return True
        except httpx.HTTPError as exc:
            log.warning("worker %s: engine %s failed (%s)", self.settings.backend_id, path,
                        describe_error(exc))
            return False

    async def _cancel_running(self) -> int:
        tasks = [t for t, _ in self._running.values()]
        for task in tasks:
            task.cancel()
        # Wait until they are gone, or a re-admitted session would look "running".
        await asyncio.gather(*tasks, return_exceptions=True)
        return len(tasks)

    # -- pulling and running --------------------------------------------------------------------
    async def _pull_loop(self, runner: SessionRunner, stop: asyncio.Event) -> None:
        s = self.settings
        while not stop.is_set():
            if not self.engine_up:  # admit nothing while the engine is down
                await asyncio.sleep(0.2)
                continue
            try:
                fresh: list[AdmittedSession] = await self._redis_until_ok(
                    self.link.read_admitted, s.read_count, s.read_block_ms)
            except BackendReclaimed:
                # Our heartbeat lapsed and the broker requeued our sessions: anything we still
                # run would be refused at finish, so stop it and start over.
                log.warning("worker %s: reclaimed by the broker; registering again", s.backend_id)
                await self._cancel_running()
                await self._register()
                continue
            if stop.is_set() or not self.engine_up:
                continue  # read after the stop or the circuit opened: leave them admitted
            fresh = [a for a in fresh if a.session.session_id not in self._running]
            if not fresh:
                continue
            ok = await self._redis_until_ok(self.link.mark_running_many,
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
        metrics.RUNNING.set(len(self._running))

    async def _run_one(self, runner: SessionRunner, a: AdmittedSession, progress: Progress) -> None:
        async def checkpoint(partial: PartialRollout) -> None:
            await self._checkpoint(a.session.model_copy(update={"resume_from": partial}))

        workload = a.session.workload
        started = time.monotonic()
        try:
            # Older sessions first: an engine scheduling by priority serves their turns before

            out = await runner.run(a.session, progress, checkpoint=checkpoint,
                                   priority=a.admitted_ms)
            metrics.SESSION_SECONDS.labels(workload).observe(time.monotonic() - started)
            for turn in out.turns:
                metrics.TURN_SECONDS.labels(workload).observe(turn.wall_s)
            self._finishing[a.session.session_id] = progress
            await self._finished.put((out.result, out.stats))
        except Handoff as cut:  # draining: back to the queue with what it had generated
            metrics.HANDED_BACK.labels("drain").inc()
            await self._hand_back(a.session.model_copy(update={"resume_from": cut.partial}),
                                  str(cut), replace_body=True)
        except (EngineUnavailable, ToolUnavailable) as exc:  # not the session's fault
            metrics.HANDED_BACK.labels(
                "engine" if isinstance(exc, EngineUnavailable) else "tool").inc()
            await self._hand_back(a.session, str(exc))
        except Exception as exc:  # a bug of ours, not the session's: end it, with the reason
            log.exception("worker %s: session %s crashed", self.settings.backend_id,
                          a.session.session_id)
            self._finishing[a.session.session_id] = progress
            await self._finished.put((crashed_result(a.session, exc), CompletionStats()))
        finally:
            self._running.pop(a.session.session_id, None)
            metrics.RUNNING.set(len(self._running))

    async def _checkpoint(self, session: Session) -> None:
        """Store what the session has done (its finished turns) for a requeue to go on from;
        a Redis error skips this one (the next turn's, or the previous, stands)."""
        try:
            await self._redis(self.link.checkpoint, session)
        except Exception as exc:
            log.log(logging.DEBUG if is_outage(exc) else logging.WARNING,
                    "worker %s: checkpoint of %s skipped (%s)", self.settings.backend_id,
                    session.session_id, describe_error(exc))

    async def _hand_back(self, session: Session, why: str, replace_body: bool = False) -> None:
        try:
            requeued, failed = await self._redis_until_ok(self.link.hand_back, [session], why,
                                                          None, replace_body)
        except Exception:
            log.exception("worker %s: handing %s back failed", self.settings.backend_id,
                          session.session_id)
            return
        self.counters.handed_back += requeued
        self.counters.failed += failed
        log.info("worker %s: session %s handed back (%s)", self.settings.backend_id,
                 session.session_id, why if requeued else f"{why}; out of attempts, failed")

    async def _finish_loop(self) -> None:
        while True:
            batch = [await self._finished.get()]
            while not self._finished.empty() and len(batch) < 200:
                batch.append(self._finished.get_nowait())
            try:
                replies = await self._publish(batch)
                for (result, _), reply in zip(batch, replies):
                    if reply == "ok":
                        self.counters.finished += 1
                        self.counters.failed += result.status == "failed"
                        metrics.SESSIONS.labels(result.workload, str(result.status)).inc()
                        metrics.GENERATED.labels(result.workload).inc(result.output_tokens)
                    else:
                        self.counters.refused += 1
                        log.info("session %s: finish said %s; dropped", result.session_id, reply)
            except Exception:
                log.exception("worker %s: finishing %d sessions failed", self.settings.backend_id,
                              len(batch))
            finally:
                for result, _ in batch:
                    self._finishing.pop(result.session_id, None)
                    self._finished.task_done()

    async def _publish(self, batch: list[tuple[SessionResult, CompletionStats]]) -> list[str]:
        """`finish_many` until Redis takes it. A retry after a lost reply finds the sessions
        already finished ('duplicate'): that retry's 'duplicate' means our own 'ok'."""
        first_try = True
        while True:
            try:
                replies = await self._redis(self.link.finish_many, batch)
            except Exception as exc:
                if not is_outage(exc):
                    raise
                first_try = False
                await asyncio.sleep(self._outage.failed(exc))
                continue
            self._outage.ok()
            return replies if first_try else ["ok" if r == "duplicate" else r for r in replies]

    # -- heartbeats and the engine's health ------------------------------------------------------
    def _beat_thread(self, done: threading.Event) -> None:
        """Beat every `heartbeat_s` from a thread of its own: a busy event loop (hundreds of
        sessions starting at once) delays nothing here. Beats stop only while the engine is
        down or the worker is not registered."""
        s = self.settings
        while True:
            self._beat_once()
            if done.wait(s.heartbeat_s):
                return

    def _beat_once(self) -> None:
        s = self.settings
        if not (self.engine_up and self._registered.is_set()) or self._scrape is None:
            return
        progress = self._listed()
        engine_metrics, shared = self._scrape.metrics, None
        try:
            if self.tenancy is not None:  # this namespace's part of the engine
                self.tenancy.read_stake(s.namespace, Stake(*self.link.stake()))
                assert self.info is not None
                part = self.tenancy.part(s.namespace, self.info.capacity_tokens,
                                         engine_metrics.kv_usage)
                engine_metrics = engine_metrics.model_copy(update={"kv_usage": part.kv_usage})
                shared = self.tenancy.shared_part(s.namespace, part)
            self.link.heartbeat(engine_metrics, progress, at=self._scraped_at,
                                adapters=self.adapters.names if self.adapters else (),
                                draining=self.draining, shared=shared)
        except Exception as exc:
            if is_outage(exc):
                self._outage.failed(exc)
            elif isinstance(exc, NotRegistered):  # the pull loop's next reclaim registers
                log.warning("worker %s: heartbeat refused: not registered", s.backend_id)
            else:
                log.exception("worker %s: heartbeat failed", s.backend_id)
            return
        self._outage.ok()

    def _listed(self) -> list[SessionProgress]:
        """What the beats list: the sessions running here and those ended but not yet
        published."""
        return [p.snapshot() for _, p in list(self._running.values())] + \
               [p.snapshot() for p in list(self._finishing.values())]

    def _holdings(self) -> tuple[int, frozenset[str]]:
        """What this namespace's sessions hold on the engine now: their context tokens and
        the engine names of the adapters they use (read from other namespaces' beats)."""
        kv = sum(p.context_tokens for _, p in list(self._running.values()))
        return kv, self.adapters.in_use() if self.adapters is not None else frozenset()

    async def _watch_engine(self, http: httpx.AsyncClient, stop: asyncio.Event) -> None:
        """The circuit breaker: GET /health every beat; open on a refused connection or
        `engine_down_after_s` without an answer, close when it answers again."""
        s = self.settings
        while not stop.is_set():
            started = time.monotonic()
            why = await self._probe_health(http)
            now = time.monotonic()
            if why is None:
                self._health_ok_at = now
                if not self.engine_up:
                    await self._engine_back(http)
            elif self.engine_up and (why.startswith("refused")
                                     or now - self._health_ok_at >= s.engine_down_after_s):
                await self._engine_down(why)
            await asyncio.sleep(max(0.0, s.heartbeat_s - (time.monotonic() - started)))

    async def _probe_health(self, http: httpx.AsyncClient) -> str | None:
        """None when /health answers 200, else why not ('refused: ...' when nothing listens)."""
        try:
            r = await http.get(f"{self.engine_url}/health", timeout=self.settings.health_timeout_s)
        except httpx.ConnectError as exc:
            return f"refused: {describe_error(exc)}"
        except httpx.HTTPError as exc:
            return describe_error(exc)
        return None if r.status_code == 200 else f"HTTP {r.status_code}"

    async def _engine_down(self, why: str) -> None:
        s = self.settings
        self.engine_up = False
        self.counters.engine_down += 1
        silent = time.monotonic() - self._health_ok_at
        log.error("worker %s: engine down (%s; /health last answered %.1fs ago): handing "
                  "everything admitted here back until it answers", s.backend_id, why, silent)
        cancelled = await self._cancel_running()
        self.counters.handed_back += cancelled
        await self._withdraw(deadline_s=s.engine_down_after_s)

    async def _engine_back(self, http: httpx.AsyncClient) -> None:
        log.warning("worker %s: engine answers again; registering", self.settings.backend_id)
        # It may have restarted on the weights it was started with: the version the namespace
        # serves goes in again first.
        if self.weights.version is not None:
            if not await self._load_weights(self.weights.version):
                return
            await self._label_weights(http, self.weights.version)
        self.engine_up = True
        await self._register()

    async def _scrape_once(self, http: httpx.AsyncClient) -> None:
        try:
            r = await http.get(f"{self.engine_url}/metrics",
                               timeout=self.settings.engine_down_after_s)
            r.raise_for_status()
            self._scrape = parse_metrics(r.text)
            self._scraped_at = time.time()
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("worker %s: /metrics: %s", self.settings.backend_id, describe_error(exc))

    async def _scrape_loop(self, http: httpx.AsyncClient) -> None:
        while True:
            started = time.monotonic()
            await self._scrape_once(http)
            await asyncio.sleep(max(0.0, self.settings.heartbeat_s - (time.monotonic() - started)))


def crashed_result(session: Session, exc: BaseException) -> SessionResult:
    """The result of a session the worker itself failed on (a bug): failed, with the reason."""
    return SessionResult(session_id=session.session_id, workload=session.workload,
                         group_id=session.group_id, group_size=session.group_size,
                         status=SessionState.failed,
                         error=f"worker: {describe_error(exc)}",
                         policy_version=session.policy_version)
