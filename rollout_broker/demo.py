"""`rollout-broker demo`: the whole system on one machine, no set-up, then a summary.

Starts (each child in a process group of its own, so a worker's engine dies with it):
a Redis server unless one answers (`ensure_redis`), N workers each with a simulated engine
(`--engine sim:PROFILE`, time-scaled, small KV), optionally RQ tool workers, and the broker.
This process is the synthetic trainer: it keeps `inflight_bound` sessions of the scenario in
flight, choosing the workload furthest below its target share, and reads results in batches of
`batch_size` (one trainer iteration). Live view: queue depth per workload, KV usage per engine,
throughput and mixture drift. At the end, or on Ctrl-C / SIGTERM: stop every child (SIGTERM to
its group, SIGKILL after a grace), delete the demo's keys, print the summary.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import redis
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from broker.client import RolloutClient
from broker.heartbeat import parse_heartbeat
from broker.keys import Keys
from broker.mixture import mixture_drift
from broker.policies import DEFAULT_POLICY, check_live_policy
from broker.redis_conn import check_redis_url, connect, delete_namespace
from broker.redis_server import RedisHandle, ensure_redis
from broker.session import Session, SessionResult, SessionState
from scenarios import scenario_path
from sim.workloads.truth import with_truth
from workers.tools import purge_tool_queues, tool_queues

if TYPE_CHECKING:
    from sim.scenario import Scenario

ROOT = Path(__file__).resolve().parents[1]  # where `broker` is imported from: children use it too
DEFAULT_SCENARIO = scenario_path("demo.yaml")


@dataclass(slots=True)
class DemoSettings:
    engines: int = 4
    duration_s: float = 60.0
    policy: str = DEFAULT_POLICY
    scenario: Path = DEFAULT_SCENARIO
    time_scale: float = 20.0
    kv_tokens: int | None = None  # default: the scenario's fleet.kv_tokens
    tools: str = "inline"  # inline | rq
    # rq only: an RQ tool worker runs one job at a time, and spends most of a job waiting on
    # its ~20 Redis round trips, so on a busy host more of them than the demo's tool calls
    # overlap (~6 at ×20) keep the queues short: 16 finished 12-27% more sessions than 8 in
    # four paired 20 s demos; 32 no more than 16.
    tool_workers: int = 16
    redis_url: str | None = None
    ready_timeout_s: float = 120.0


# -- children ----------------------------------------------------------------------------------

@dataclass
class Children:
    """Processes we started, each the leader of its own process group."""

    logdir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "wb")
        p = subprocess.Popen([sys.executable, "-m", "rollout_broker.cli", *args], cwd=ROOT,
                             stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        log.close()
        self.procs[name] = p
        return p

    def dead(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def log_tail(self, name: str, lines: int = 15) -> str:
        text = (self.logdir / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self, order: Sequence[Sequence[str]] = (), grace_s: float = 15.0) -> None:
        """Stop in dependency order: stage by stage (`order`, then every other process), each
        process SIGTERMed alone and waited for, within one grace period overall. Alone, not its
        group: a worker drains first, then stops the engine it started, which must outlive the
        drain. Then every group is killed (an engine outliving its worker)."""
        deadline = time.monotonic() + grace_s
        staged = {n for stage in order for n in stage}
        for stage in [*order, [n for n in self.procs if n not in staged]]:
            procs = [self.procs[n] for n in stage if n in self.procs]
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for p in self.procs.values():
            _signal_group(p, signal.SIGKILL)
            if p.poll() is None:
                p.wait()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# -- the synthetic trainer ----------------------------------------------------------------------

@dataclass
class TrainerStats:
    started: float = field(default_factory=time.monotonic)
    enqueued: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    enqueued_at: dict[str, float] = field(default_factory=dict)
    results: list[tuple[SessionResult, float]] = field(default_factory=list)  # (result, latency)
    iteration_drift: list[float] = field(default_factory=list)
    iteration_s: list[float] = field(default_factory=list)

    @property
    def in_flight(self) -> int:
        return sum(self.enqueued.values()) - len(self.results)

    def done(self, w: str | None = None) -> list[SessionResult]:
        return [r for r, _ in self.results if w is None or r.workload == w]


def drift(batch: list[SessionResult], mixture: dict[str, float]) -> float:
    """`mixture_drift` of one iteration's results (0 for an empty one)."""
    return mixture_drift(Counter(r.workload for r in batch), mixture) if batch else 0.0


class Trainer:
    def __init__(self, client: RolloutClient, scenario, mixture: dict[str, float]) -> None:
        from sim.workloads.source import GeneratedSource

        self.client = client
        self.scenario = scenario
        self.mixture = mixture
        self.source = GeneratedSource(scenario)
        self.stats = TrainerStats()
        self._batch: list[SessionResult] = []
        self._last_iteration = time.monotonic()
        self._next: tuple[str, tuple] | None = None  # drawn, waiting for room in flight

    def top_up(self) -> None:
        """Enqueue whole groups while they fit under the in-flight bound; a group drawn that
        does not fit yet is kept and enqueued first next time (never dropped)."""
        bound = self.scenario.trainer.inflight_bound
        while True:
            if self._next is None:
                total = sum(self.stats.enqueued.values()) or 1
                w = min(self.mixture,
                        key=lambda w: self.stats.enqueued[w] / total - self.mixture[w])
                group = self.source.next_group(w)
                if group is None:
                    return
                self._next = (w, group)
            w, group = self._next
            if self.stats.in_flight + len(group) > bound:
                return
            now = time.monotonic()
            self.client.enqueue([with_truth(s) for s in group])
            self._next = None
            for s in group:
                self.stats.enqueued_at[s.session_id] = now
            self.stats.enqueued[w] += len(group)

    def collect(self, timeout: float) -> None:
        got = self.client.results(self.scenario.trainer.batch_size, timeout=timeout)
        now = time.monotonic()
        for r in got:
            self.stats.results.append((r, now - self.stats.enqueued_at.get(r.session_id, now)))
        self._batch += got
        b = self.scenario.trainer.batch_size
        while len(self._batch) >= b:
            it, self._batch = self._batch[:b], self._batch[b:]
            self.stats.iteration_drift.append(drift(it, self.mixture))
            self.stats.iteration_s.append(now - self._last_iteration)
            self._last_iteration = now


# -- the view -----------------------------------------------------------------------------------

def _engines(r: redis.Redis, keys: Keys, backends: list[str]) -> dict[str, dict]:
    pipe = r.pipeline(transaction=False)
    for b in backends:
        pipe.get(keys.heartbeat(b))
    out = {}
    for b, raw in zip(backends, pipe.execute()):
        hb = parse_heartbeat(raw)
        out[b] = hb.metrics.model_dump() if hb is not None else None
    return out


def live_view(trainer: Trainer, status: dict, engines: dict[str, dict | None], elapsed: float,
              duration: float) -> Group:
    st = trainer.stats
    done = st.done()
    tokens = sum(r.output_tokens for r in done)
    mean_drift = statistics.fmean(st.iteration_drift) if st.iteration_drift else 0.0
    head = Table.grid(padding=(0, 3))
    # The summary's figure, over the same span; nothing until a second has passed (a rate over
    # the first milliseconds is noise: the first frame once showed 35,852,874 tok/s).
    rate = f"{tokens / elapsed:,.0f}" if elapsed >= 1.0 else "-"
    head.add_row(f"[bold]rollout-broker demo[/] {elapsed:5.1f}/{duration:.0f}s",
                 f"sessions done [bold]{len(done)}[/]", f"in flight {st.in_flight}",
                 f"throughput [bold]{rate}[/] tok/s",
                 f"drift {mean_drift:.3f}")
    wl = Table(title="workloads", expand=False)
    for col in ("workload", "target π", "queued", "done", "failed", "share done", "tokens"):
        wl.add_column(col, justify="right")
    for w, p in trainer.mixture.items():
        mine = st.done(w)
        wl.add_row(w, f"{p:.2f}", str(status["pending"].get(w, 0)), str(len(mine)),
                   str(sum(r.status == SessionState.failed for r in mine)),
                   f"{len(mine) / max(1, len(done)):.2f}", f"{sum(r.output_tokens for r in mine):,}")
    en = Table(title="engines", expand=False)
    for col in ("backend", "healthy", "KV usage", "running", "waiting", "reserved", "preempt",
                "prefix hit"):
        en.add_column(col, justify="right")
    for b, led in sorted(status["backends"].items()):
        m = engines.get(b)
        kv = f"{m['kv_usage']:.0%}" if m else "-"
        hit = (f"{m['prefix_hits_total'] / m['prefix_queries_total']:.0%}"
               if m and m["prefix_queries_total"] else "-")
        en.add_row(b, "yes" if led["healthy"] else "[red]no[/]", kv,
                   str(m["running"]) if m else "-", str(m["waiting"]) if m else "-",
                   f"{led['reserved_tokens']:,}/{led['capacity_tokens']:,}",
                   str(m["preemptions_total"]) if m else "-", hit)
    return Group(head, wl, en)


def summary(trainer: Trainer, engines: dict[str, dict | None], elapsed: float) -> Table:
    st = trainer.stats
    t = Table(title=f"summary: {len(st.results)} sessions in {elapsed:.1f}s")
    for col in ("workload", "done", "failed", "output tokens", "tok/s", "cached tokens",
                "p50 latency", "p99 latency", "mean reward"):
        t.add_column(col, justify="right")
    for w in [*trainer.mixture, None]:
        rows = [(r, lat) for r, lat in st.results if w is None or r.workload == w]
        ok = [r for r, _ in rows if r.status == SessionState.done]
        lats = sorted(lat for _, lat in rows)
        tokens = sum(r.output_tokens for r, _ in rows)
        cached = sum(r.cached_tokens for r, _ in rows)
        rewards = [r.reward for r in ok if r.reward is not None]
        t.add_row(w or "[bold]all[/]", str(len(ok)), str(len(rows) - len(ok)), f"{tokens:,}",
                  f"{tokens / max(elapsed, 1e-9):,.0f}",
                  f"{cached:,}",
                  f"{lats[len(lats) // 2]:.2f}s" if lats else "-",
                  f"{lats[min(len(lats) - 1, int(0.99 * len(lats)))]:.2f}s" if lats else "-",
                  f"{statistics.fmean(rewards):.3f}" if rewards else "-")
    t.caption = (f"{len(st.iteration_drift)} iterations of {trainer.scenario.trainer.batch_size} sessions; "
                 f"mean drift {statistics.fmean(st.iteration_drift) if st.iteration_drift else 0:.3f}; "
                 f"mean iteration {statistics.fmean(st.iteration_s) if st.iteration_s else 0:.2f}s; "
                 "preemptions " + ", ".join(f"{b} {m['preemptions_total']}" if m else f"{b} -"
                                            for b, m in sorted(engines.items())))
    return t


# -- orchestration ------------------------------------------------------------------------------

def rq_workers_listening(r: redis.Redis, queue: str) -> int:
    """RQ workers registered on `queue` (RQ adds a worker to the queue's set when it starts
    listening and removes it when it stops)."""
    from rq import Queue, Worker

    return Worker.count(connection=r, queue=Queue(queue, connection=r))


def _wait_ready(client: RolloutClient, children: Children, backends: list[str],
                timeout_s: float, tools_ready: Callable[[], bool] | None = None,
                stop: threading.Event | None = None) -> None:
    """Until every engine's worker is healthy and `tools_ready()` (the RQ tool workers all
    listen), or `stop` is set: the trainer's clock starts on a fleet that is up (16 tool
    workers starting take about 13 s of CPU, most of a 20 s run's first seconds on 2 cores)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stop is not None and stop.is_set():
            return
        dead = children.dead()
        if dead:
            raise RuntimeError(f"demo: {dead[0]} exited on start:\n{children.log_tail(dead[0])}")
        healthy = client.status()["backends"]
        if (all(healthy.get(b, {}).get("healthy") for b in backends)
                and (tools_ready is None or tools_ready())):
            return
        time.sleep(0.2)
    what = "engines and tool workers" if tools_ready else "engines"
    raise RuntimeError(f"demo: {what} not ready within {timeout_s:.0f}s; logs in {children.logdir}")


def stop_on_signals() -> threading.Event:
    """Ctrl-C and SIGTERM set the returned event, for the caller's loops to check: an exception
    raised wherever the main thread happens to be (inside a lock of the live display's, or of a
    Redis connection's) can leave a lock held and the cleanup waiting for it forever."""
    stop = threading.Event()

    def on_signal(*_: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return stop


def terminate_on_sigterm() -> None:
    """SIGTERM as Ctrl-C: it raises KeyboardInterrupt, so the `finally` blocks that stop the
    processes this one started (each in its own process group, which a signal to this one does
    not reach) and a private Redis run before it exits. Without it SIGTERM ends the process at
    once and leaves them running (the benchmarks that start processes call it; the demo takes
    both signals as a flag instead: `stop_on_signals`)."""
    def raise_interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, raise_interrupt)


def run_until_interrupted(main: Callable[[], int], name: str) -> int:
    """`main()` with SIGTERM taken as Ctrl-C (`terminate_on_sigterm`): an interrupt returns 130
    once `main`'s `finally` blocks have stopped what it started (the benchmarks' entry point)."""
    terminate_on_sigterm()
    try:
        return main()
    except KeyboardInterrupt:
        print(f"{name}: interrupted; the processes it started are stopped", file=sys.stderr)
        return 130


def check_demo(settings: DemoSettings) -> Scenario:
    """The demo's scenario, once every setting is one the demo can run; else ValueError naming
    the option (before anything starts)."""
    from sim.engine.profiles import check_engine_options, get_profile
    from sim.scenario import load_scenario

    if settings.engines < 1:
        raise ValueError(f"engines: {settings.engines} must be at least 1")
    if not settings.duration_s > 0:
        raise ValueError(f"duration: {settings.duration_s:g} must be more than 0 seconds")
    if settings.tools not in ("inline", "rq"):
        raise ValueError(f"tools: {settings.tools!r} must be 'inline' or 'rq'")
    if settings.tool_workers < 1:
        raise ValueError(f"tool_workers: {settings.tool_workers} must be at least 1")
    if settings.redis_url is not None:
        check_redis_url(settings.redis_url)
    check_live_policy(settings.policy)
    scenario = load_scenario(settings.scenario)
    check_engine_options(settings.time_scale, settings.kv_tokens)
    get_profile(scenario.fleet.profile)
    return scenario


def run_demo(settings: DemoSettings, console: Console | None = None,
             scenario: Scenario | None = None) -> int:
    """`scenario`: what `check_demo(settings)` returned, if the caller checked already."""
    console = console or Console()
    scenario = scenario or check_demo(settings)
    kv = settings.kv_tokens or scenario.fleet.kv_tokens
    stop = stop_on_signals()
    handle: RedisHandle = ensure_redis(settings.redis_url)
    namespace = f"demo-{uuid.uuid4().hex[:8]}"
    keys = Keys(namespace)
    logdir = Path(tempfile.mkdtemp(prefix="rb-demo-"))
    children = Children(logdir)
    backends = [f"engine-{i}" for i in range(settings.engines)]
    client = RolloutClient(handle.url, namespace)
    r = connect(handle.url)
    trainer = Trainer(client, scenario, dict(scenario.mixture))
    engines: dict[str, dict | None] = {}
    started = time.monotonic()
    ended: float | None = None  # when the trainer stopped (the summary's span)
    interrupted = False
    kind = "private" if handle.owned else "existing"
    console.print(f"redis {handle.url} ({kind}: {handle.why}), namespace {namespace}, "
                  f"logs {logdir}")
    try:
        common = ["--redis-url", handle.url, "--namespace", namespace, "--log-level", "INFO"]
        for i, b in enumerate(backends):
            args = ["worker", "--backend-id", b, "--engine", f"sim:{scenario.fleet.profile}",
                    "--time-scale", repr(settings.time_scale), "--seed", str(i),
                    "--tools", settings.tools, "--drain-grace", "2", *common]
            if kv:
                args += ["--kv-tokens", str(kv)]
            children.start(b, args)
        if settings.tools == "rq":
            for i in range(settings.tool_workers):
                children.start(f"tools-{i}", ["tools", "--redis-url", handle.url,
                                               "--namespace", namespace])
        children.start("broker", ["broker", "--policy", settings.policy, "--lease-s", "2", *common])
        client.set_mixture(scenario.mixture)
        console.print(f"starting {settings.engines} engines ({scenario.fleet.profile}, "
                      f"{kv or 'profile'} KV tokens, ×{settings.time_scale:g}), policy "
                      f"{settings.policy}, scenario {scenario.name} ...")
        tool_queue = tool_queues(namespace)[0]

        def tools_ready() -> bool:
            return rq_workers_listening(r, tool_queue) >= settings.tool_workers

        _wait_ready(client, children, backends, settings.ready_timeout_s,
                    tools_ready if settings.tools == "rq" else None, stop)
        started = time.monotonic()
        with Live(console=console, refresh_per_second=4, transient=False) as live:
            while ((elapsed := time.monotonic() - started) < settings.duration_s
                   and not stop.is_set()):
                trainer.top_up()
                trainer.collect(timeout=0.25)
                engines = _engines(r, keys, backends)
                live.update(live_view(trainer, client.status(), engines, elapsed,
                                      settings.duration_s))
                dead = children.dead()
                if dead:
                    raise RuntimeError(f"demo: {dead[0]} died:\n{children.log_tail(dead[0])}")
            # The last frame and the summary: the same results over the same span.
            ended = time.monotonic() - started
            live.update(live_view(trainer, client.status(), engines, ended, settings.duration_s))
        if stop.is_set():
            interrupted = True
            console.print("[yellow]interrupted: stopping[/]")
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not skip the cleanup
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        elapsed = ended if ended is not None else time.monotonic() - started
        try:
            engines = _engines(r, keys, backends) or engines
        except redis.RedisError:
            pass
        # The trainer has stopped; then the broker (nothing more admitted), the workers (they
        # drain, publish, and stop their engines), the tool workers their drains may call.
        children.stop([["broker"], backends])
        client.close()
        if not handle.owned:  # leave someone else's Redis as we found it
            delete_namespace(r, keys.prefix)
            if settings.tools == "rq":
                purge_tool_queues(r, namespace)
        r.close()
        handle.close()
    console.print()
    console.print(summary(trainer, engines, elapsed))
    if interrupted:
        console.print("stopped early by interrupt")
        return 130  # as a shell reports a command ended by Ctrl-C (128 + SIGINT)
    return 0
