"""Fault drills: the whole system under one fault per run, and what it cost.

Each run starts from nothing: a private Redis with an append-only file (`appendfsync always`),
three simulated vLLM engines (`rollout-broker sim-engine --fault-injection`), one worker
attached to each (`--engine attach:URL`, inline tools from a registry this script writes), a
broker and a standby broker (`--policy misa_t`), each process in a session of its own. A
trainer in this process keeps `--inflight` sessions of a GRPO/RLHF/agentic mix in flight
through `RolloutClient` for `--load-s` seconds (a few thousand sessions), and reads every
result. At `--fault-at` seconds one fault is injected; it ends as the table says; then the run
goes on until every session enqueued has a result (or `--drain-timeout` passes).

Faults (`--faults`, default all, each in its own run):
  none              no fault: the reference row
  kill-broker       kill -9 the active broker; restarted 1 s later (as a supervisor would)
  kill-worker       kill -9 worker 0; restarted 3 s later with the same backend id
  kill-engine       kill -9 engine 0; restarted on its port 5 s later
  stop-engine       SIGSTOP engine 0 for 35 s (past the worker's 30 s health limit), SIGCONT
  redis-shutdown    Redis SHUTDOWN (AOF flushed), restarted 4 s later on the same port and data
  redis-kill        Redis kill -9, restarted 4 s later from its append-only file
  redis-oom         Redis maxmemory 1 byte (every write refused) for 4 s
  metrics-stall     engine 0 answers /metrics 15 s late, for 15 s
  poison            1 % of sessions name an unregistered tool, 1 % a tool that raises, and one
                    malformed entry is written to the results stream
Network faults (`sim/netfault.py`: in these runs worker 0 reaches Redis and engine 0, and broker
0 reaches Redis, through fault-injecting TCP proxies in this process):
  net-latency       50 ± 25 ms each way on those links, for 20 s
  net-reset         every connection on those links reset (RST), every 2 s for 20 s
  net-hang-redis    worker 0's Redis link stops answering, without closing, for 20 s
  net-hang-engine   worker 0's engine link stops answering, without closing, for 20 s
  net-partition-worker  worker 0 cut off from Redis and its engine for 30 s
  net-partition-broker  the active broker cut off from Redis for 30 s (the standby takes over)

One row per run: enqueued; done once; duplicated (a session delivered to the trainer more than
once, or a result left in the stream at the end: acknowledged ones leave it, so one left was
published and never delivered); lost (no result at the end); failed because of the
infrastructure (a failed result for a session whose own tool and reward are good); failed as
expected (poison sessions); dead-lettered entries; wasted finishes (results a worker finished
but could not publish: `stale_finishes`); processes that needed a manual restart (exited or
stopped heartbeating on their own); seconds from the fault's end until the next result, and
until the next result from backend w0 (where the engine and worker faults hit); the longest
gap between results during the run.

    python3 benchmarks/chaos.py [--faults kill-broker,redis-kill] [--load-s 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from broker.client import RolloutClient  # noqa: E402
from rollout_broker.demo import run_until_interrupted  # noqa: E402
from broker.keys import Keys  # noqa: E402
from broker.redis_server import RedisHandle, free_port, start_private_redis  # noqa: E402
from broker.session import Session, SessionResult, SessionState  # noqa: E402
from sim.netfault import FaultProxy  # noqa: E402

FAULTS = ("none", "kill-broker", "kill-worker", "kill-engine", "stop-engine", "redis-shutdown",
          "redis-kill", "redis-oom", "metrics-stall", "poison", "net-latency", "net-reset",
          "net-hang-redis", "net-hang-engine", "net-partition-worker", "net-partition-broker")
ENGINES = 3
NAMESPACE = "chaos"
TOOLS_TOML = """[tools]
raises = "benchmarks.chaos:raising_tool"
"""


def raising_tool(call: dict) -> dict:
    """A registered tool that always fails (the poison run's "exception in a tool")."""
    raise RuntimeError(f"chaos: this tool always fails (turn {call['turn']})")


# -- the session mix ----------------------------------------------------------------------------

def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 30000 + 1 for i in range(n)]


def session_mix(n: int, poison: bool) -> tuple[list[Session], set[str]]:
    """About `n` sessions: GRPO groups of 4 rlvr, pairs of rlhf, 3-turn agentic episodes with
    the simulated tool. With `poison`, every 100th group's agentic episode names a tool nobody
    registered and every 100th (offset 50) names the registered tool that raises."""
    out: list[Session] = []
    bad: set[str] = set()
    g = 0
    while len(out) < n:
        shared = _prompt(g, 256)
        for m in range(4):
            out.append(Session(session_id=f"rlvr-{g}-{m}", workload="rlvr", group_id=f"rlvr-{g}",
                               group_size=4, prompt_token_ids=shared, max_tokens=256,
                               metadata={"reward": "parity",
                                         "sim_output_tokens": str(32 + (g * 7 + m * 13) % 96)}))
        for m in range(2):
            out.append(Session(session_id=f"rlhf-{g}-{m}", workload="rlhf", group_id=f"rlhf-{g}",
                               group_size=2, prompt_token_ids=_prompt(10_000 + g, 160),
                               max_tokens=128, metadata={"reward": "parity",
                                                         "sim_output_tokens": "24"}))
        tool = "sim"
        if poison and g % 100 == 0:
            tool = "no-such-tool"
        elif poison and g % 100 == 50:
            tool = "raises"
        sid = f"agentic-{g}"
        if tool != "sim":
            bad.add(sid)
        out.append(Session(session_id=sid, workload="agentic", prompt_token_ids=_prompt(20_000 + g, 384),
                           max_tokens=64, max_turns=3,
                           metadata={"tool": tool, "reward": "parity", "sim_turns": 3,
                                     "sim_output_tokens": "32,32,32",
                                     "sim_tool_latency_s": "2,2",
                                     "sim_observation_tokens": "48,48"}))
        g += 1
    return out, bad


# -- processes ----------------------------------------------------------------------------------

@dataclass
class Proc:
    name: str
    args: list[str]
    log: Path
    process: subprocess.Popen | None = None
    killed_by_us: bool = False

    def start(self, env: dict[str, str]) -> Proc:
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "rollout_broker.cli", *self.args], cwd=ROOT, env=env,
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        return self

    def signal(self, sig: int) -> None:
        if self.process is not None:
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.killed_by_us = True
        self.signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


def wait_http(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"chaos: {url} did not answer within {timeout_s:.0f}s")


class Fleet:
    """Redis, engines, workers and two brokers for one run; stopped in `close`."""

    def __init__(self, workdir: Path, time_scale: float, kv_tokens: int,
                 proxied: bool = False) -> None:
        self.workdir = workdir
        self.redis_dir = workdir / "redis"
        self.redis_dir.mkdir()
        self.redis_port = free_port()
        self.redis: RedisHandle | None = None
        self.time_scale = time_scale
        self.kv_tokens = kv_tokens
        tools = workdir / "tools.toml"
        tools.write_text(TOOLS_TOML)
        self.env = dict(os.environ, PYTHONPATH=str(ROOT), RB_TOOL_CONFIG=str(tools))
        self.engine_ports = [free_port() for _ in range(ENGINES)]
        self.engines: list[Proc] = []
        self.workers: list[Proc] = []
        self.brokers: list[Proc] = []
        # Worker 0's links to Redis and its engine, and broker 0's to Redis (net-* faults).
        self.proxies: dict[str, FaultProxy] = {}
        if proxied:
            self.proxies = {"w0-redis": FaultProxy("127.0.0.1", self.redis_port),
                            "w0-engine": FaultProxy("127.0.0.1", self.engine_ports[0]),
                            "b0-redis": FaultProxy("127.0.0.1", self.redis_port)}

    def _via(self, link: str, port: int) -> int:
        proxy = self.proxies.get(link)
        return proxy.port if proxy is not None else port

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def start_redis(self) -> None:
        self.redis = start_private_redis(
            appendonly=True, port=self.redis_port, workdir=str(self.redis_dir),
            extra_args=("--appendfsync", "always", "--maxmemory-policy", "noeviction"))

    def engine(self, i: int) -> Proc:
        return Proc(f"engine-{i}", ["sim-engine", "--port", str(self.engine_ports[i]),
                                    "--profile", "h100-8b", "--time-scale", repr(self.time_scale),
                                    "--kv-tokens", str(self.kv_tokens), "--seed", str(i),
                                    "--fault-injection"], self.workdir / f"engine-{i}.log")

    def worker(self, i: int) -> Proc:
        engine = self._via(f"w{i}-engine", self.engine_ports[i])
        redis_port = self._via(f"w{i}-redis", self.redis_port)
        return Proc(f"worker-{i}", ["worker", "--backend-id", f"w{i}", "--engine",
                                    f"attach:http://127.0.0.1:{engine}",
                                    "--redis-url", f"redis://127.0.0.1:{redis_port}/0",
                                    "--namespace", NAMESPACE,
                                    "--time-scale", repr(self.time_scale), "--drain-grace", "5",
                                    "--log-level", "INFO"], self.workdir / f"worker-{i}.log")

    def broker(self, i: int) -> Proc:
        redis_port = self._via(f"b{i}-redis", self.redis_port)
        return Proc(f"broker-{i}", ["broker", "--redis-url", f"redis://127.0.0.1:{redis_port}/0",
                                    "--namespace", NAMESPACE,
                                    "--policy", "misa_t", "--log-level", "INFO"],
                    self.workdir / f"broker-{i}.log")

    def start(self) -> None:
        self.start_redis()
        self.engines = [self.engine(i).start(self.env) for i in range(ENGINES)]
        for port in self.engine_ports:
            wait_http(f"http://127.0.0.1:{port}/health")
        self.workers = [self.worker(i).start(self.env) for i in range(ENGINES)]
        self.brokers = [self.broker(0).start(self.env)]
        r = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 60
        while not r.exists(Keys(NAMESPACE).lease):  # broker 0 is the active one
            if time.monotonic() > deadline:
                raise RuntimeError("chaos: the broker took no lease within 60 s")
            time.sleep(0.1)
        self.brokers.append(self.broker(1).start(self.env))
        while not all(r.exists(Keys(NAMESPACE).heartbeat(f"w{i}")) for i in range(ENGINES)):
            if time.monotonic() > deadline:
                raise RuntimeError("chaos: the workers did not heartbeat within 60 s")
            time.sleep(0.1)
        r.close()

    def restart(self, procs: list[Proc], i: int, make) -> None:
        procs[i] = make(i).start(self.env)

    def all_procs(self) -> list[Proc]:
        return self.engines + self.workers + self.brokers

    def close(self) -> None:
        for p in self.all_procs():
            p.signal(signal.SIGCONT)
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self.all_procs():
            if p.process is not None:
                try:
                    p.process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            p.signal(signal.SIGKILL)
        if self.redis is not None:
            self.redis.close()
        for proxy in self.proxies.values():
            proxy.close()


# -- one run ------------------------------------------------------------------------------------

@dataclass
class Row:
    fault: str
    enqueued: int = 0
    done_once: int = 0
    duplicated: int = 0
    lost: int = 0
    failed_infra: int = 0
    failed_expected: int = 0
    dead_lettered: int = 0
    wasted_finishes: int = 0
    manual_restarts: int = 0
    recovery_s: float | None = None  # fault end -> next result
    w0_back_s: float | None = None  # fault end -> next result from backend w0 (where it hit)
    max_gap_s: float = 0.0
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)


class Trainer(threading.Thread):
    """Keeps `inflight` sessions in flight and reads results (exactly what a trainer does)."""

    def __init__(self, url: str, sessions: list[Session], inflight: int, load_s: float) -> None:
        super().__init__(daemon=True)
        self.client = RolloutClient(url, NAMESPACE)
        self.sessions = sessions
        self.inflight = inflight
        self.load_until = time.monotonic() + load_s
        self.delivered: list[tuple[SessionResult, float]] = []  # (result, wall time read)
        self.enqueued = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                room = self.inflight - (self.enqueued - len(self.delivered))
                if room > 0 and self.enqueued < len(self.sessions) and \
                        time.monotonic() < self.load_until:
                    batch = self.sessions[self.enqueued:self.enqueued + room]
                    self.client.enqueue(batch)
                    self.enqueued += len(batch)
                got = self.client.results(64, timeout=0.5)
                now = time.time()
                self.delivered += [(r, now) for r in got]
            self.client.ack()
        except BaseException as exc:  # reported in the row
            self.error = exc


def inject(fault: str, fleet: Fleet) -> float:
    """Inject `fault`; returns the wall time (unix) at which it ended."""
    if fault == "kill-broker":
        fleet.brokers[0].kill()
        time.sleep(1.0)
        fleet.restart(fleet.brokers, 0, fleet.broker)
        return time.time()
    if fault == "kill-worker":
        fleet.workers[0].kill()
        time.sleep(3.0)
        fleet.restart(fleet.workers, 0, fleet.worker)
        return time.time()
    if fault == "kill-engine":
        fleet.engines[0].kill()
        time.sleep(5.0)
        fleet.restart(fleet.engines, 0, fleet.engine)
        wait_http(f"http://127.0.0.1:{fleet.engine_ports[0]}/health")
        return time.time()
    if fault == "stop-engine":
        fleet.engines[0].signal(signal.SIGSTOP)
        time.sleep(35.0)
        fleet.engines[0].signal(signal.SIGCONT)
        return time.time()
    if fault in ("redis-shutdown", "redis-kill"):
        assert fleet.redis is not None and fleet.redis.process is not None
        if fault == "redis-shutdown":
            try:
                redis.Redis.from_url(fleet.url).shutdown(save=False)
            except redis.ConnectionError:
                pass  # SHUTDOWN closes the connection: that is the answer
        else:
            fleet.redis.process.kill()
        fleet.redis.process.wait()
        time.sleep(4.0)
        fleet.start_redis()
        return time.time()
    if fault == "redis-oom":
        r = redis.Redis.from_url(fleet.url)
        r.config_set("maxmemory", 1)
        time.sleep(4.0)
        r.config_set("maxmemory", 0)
        r.close()
        return time.time()
    if fault == "metrics-stall":
        url = f"http://127.0.0.1:{fleet.engine_ports[0]}/sim/faults"
        httpx.post(url, json={"metrics_delay_s": 15.0}, timeout=5).raise_for_status()
        time.sleep(15.0)
        httpx.post(url, json={"metrics_delay_s": 0.0}, timeout=20).raise_for_status()
        return time.time()
    if fault.startswith("net-"):
        return inject_network(fault, fleet)
    if fault == "poison":
        r = redis.Redis.from_url(fleet.url)
        r.xadd(Keys(NAMESPACE).results, {"sid": "not-a-session", "result": "{not json"})
        r.close()
        return time.time()
    return time.time()


def inject_network(fault: str, fleet: Fleet) -> float:
    p = fleet.proxies
    if fault == "net-latency":
        for proxy in p.values():
            proxy.set_latency(0.05, 0.025)
        time.sleep(20.0)
        for proxy in p.values():
            proxy.set_latency(0.0)
    elif fault == "net-reset":
        for _ in range(10):
            for proxy in p.values():
                proxy.reset()
            time.sleep(2.0)
    elif fault in ("net-hang-redis", "net-hang-engine", "net-partition-worker",
                   "net-partition-broker"):
        links = {"net-hang-redis": ["w0-redis"], "net-hang-engine": ["w0-engine"],
                 "net-partition-worker": ["w0-redis", "w0-engine"],
                 "net-partition-broker": ["b0-redis"]}[fault]
        for link in links:
            p[link].blackhole(True)
        time.sleep(30.0 if "partition" in fault else 20.0)
        for link in links:
            p[link].blackhole(False)
    return time.time()


def run_fault(fault: str, args: argparse.Namespace, keep: bool) -> Row:
    workdir = Path(tempfile.mkdtemp(prefix=f"rb-chaos-{fault}-"))
    fleet = Fleet(workdir, args.time_scale, args.kv_tokens, proxied=fault.startswith("net-"))
    sessions, bad = session_mix(args.sessions, poison=fault == "poison")
    row = Row(fault=fault)
    started = time.monotonic()
    fleet.start()
    trainer = Trainer(fleet.url, sessions, args.inflight, args.load_s)
    fault_end: float | None = None
    try:
        t0 = time.time()
        trainer.start()
        time.sleep(max(0.0, args.fault_at - (time.time() - t0)))
        fault_end = inject(fault, fleet)
        deadline = trainer.load_until + args.drain_timeout
        while time.monotonic() < deadline:
            if time.monotonic() > trainer.load_until and \
                    len({r.session_id for r, _ in trainer.delivered}) >= trainer.enqueued:
                break
            if trainer.error is not None:
                row.notes.append(f"trainer: {type(trainer.error).__name__}: {trainer.error}")
                break
            time.sleep(0.5)
        trainer.stop.set()
        trainer.join(timeout=30)
        row.wall_s = round(time.monotonic() - started, 1)
        measure(row, fleet, trainer, sessions, bad, fault_end, t0)
    finally:
        fleet.close()
        trainer.client.close()
    if not keep:
        subprocess.run(["rm", "-rf", str(workdir)], check=False)
    else:
        row.notes.append(f"logs in {workdir}")
    return row


@dataclass
class Delivery:
    """Exactly-once, judged on what the trainer was handed, per enqueued session."""

    per_sid: dict[str, list[SessionResult]]
    lost: int  # enqueued, never handed over
    duplicated: int  # handed over more than once, plus results published and never handed over
    done_once: int  # handed over exactly once, done
    failed: set[str]  # handed over failed
    notes: list[str]


def delivery(delivered: list[tuple[SessionResult, float]], ids: list[str],
             redis_url: str) -> Delivery:
    """`delivered`: the trainer's (result, read at); `ids`: the sessions it enqueued."""
    per_sid: dict[str, list[SessionResult]] = {}
    for res, _ in delivered:
        per_sid.setdefault(res.session_id, []).append(res)
    notes = []
    duplicated = sum(1 for sid in ids if len(per_sid.get(sid, ())) > 1)
    # Acknowledged results leave the stream, and the trainer acknowledged all it was handed: an
    # entry left is a result published and never handed on.
    r = redis.Redis.from_url(redis_url)
    left = r.xlen(Keys(NAMESPACE).results)
    r.close()
    if left:
        duplicated += left
        notes.append(f"{left} results published and never delivered")
    return Delivery(
        per_sid=per_sid, lost=sum(1 for sid in ids if sid not in per_sid), duplicated=duplicated,
        done_once=sum(1 for sid in ids
                      if [x.status for x in per_sid.get(sid, ())] == [SessionState.done]),
        failed={sid for sid in ids
                if SessionState.failed in [x.status for x in per_sid.get(sid, ())]},
        notes=notes)


def measure(row: Row, fleet: Fleet, trainer: Trainer, sessions: list[Session], bad: set[str],
            fault_end: float | None, t0: float) -> None:
    k = Keys(NAMESPACE)
    r = redis.Redis.from_url(fleet.url)
    times: list[float] = []  # when each result was published (its finished_at)
    w0_times: list[float] = []
    for res, read_at in trainer.delivered:
        times.append(res.finished_at or read_at)
        if res.backend_id == "w0":
            w0_times.append(times[-1])
    row.enqueued = trainer.enqueued
    d = delivery(trainer.delivered, [s.session_id for s in sessions[:trainer.enqueued]],
                 fleet.url)
    per_sid, failed = d.per_sid, d.failed
    row.duplicated, row.lost, row.done_once = d.duplicated, d.lost, d.done_once
    row.notes += d.notes
    row.failed_expected = len(failed & bad)
    row.failed_infra = len(failed - bad)
    row.dead_lettered = r.xlen(k.dead_letter)
    row.wasted_finishes = int(r.hget(k.stats, "stale_finishes") or 0)
    for sid in sorted(failed - bad)[:3]:
        error = next(x.error for x in per_sid[sid] if x.status == SessionState.failed)
        row.notes.append(f"{sid} failed: {error}")
    # Processes that ended or went silent by themselves (the ones we killed were restarted).
    for p in fleet.all_procs():
        if not p.alive():
            row.manual_restarts += 1
            row.notes.append(f"{p.name} exited with {p.process.returncode if p.process else '?'}")
    for i in range(ENGINES):
        if not r.exists(k.heartbeat(f"w{i}")):
            row.manual_restarts += 1
            row.notes.append(f"worker w{i} is not heartbeating")
    if not r.exists(k.lease):
        row.manual_restarts += 1
        row.notes.append("no broker holds the lease")
    times.sort()
    after = [t for t in times if fault_end is not None and t > fault_end]
    row.recovery_s = round(after[0] - fault_end, 2) if after else None
    w0_after = sorted(t for t in w0_times if fault_end is not None and t > fault_end)
    row.w0_back_s = round(w0_after[0] - fault_end, 2) if w0_after else None
    gaps = [b - a for a, b in zip(times, times[1:]) if a >= t0]
    row.max_gap_s = round(max(gaps, default=0.0), 2)
    r.close()


def table(rows: list[Row]) -> str:
    head = ("| fault | enqueued | done once | duplicated | lost | failed (infra) | "
            "failed (own fault) | dead-lettered | wasted finishes | manual restarts | "
            "results again after s | w0's results again after s | longest gap s | run s |")
    out = [head, "|" + "---|" * 14]

    def sec(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"
    for r in rows:
        out.append(f"| {r.fault} | {r.enqueued:,} | {r.done_once:,} | {r.duplicated} | {r.lost} | "
                   f"{r.failed_infra} | {r.failed_expected} | {r.dead_lettered} | "
                   f"{r.wasted_finishes} | {r.manual_restarts} | {sec(r.recovery_s)} | "
                   f"{sec(r.w0_back_s)} | {r.max_gap_s:.2f} | {r.wall_s:.0f} |")
    return "\n".join(out)


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", default=",".join(FAULTS),
                    help=f"comma-separated, from: {', '.join(FAULTS)}")
    ap.add_argument("--load-s", type=float, default=50.0,
                    help="seconds the trainer keeps enqueueing (the fault falls inside)")
    ap.add_argument("--sessions", type=int, default=20_000, help="at most this many per run")
    ap.add_argument("--inflight", type=int, default=200, help="sessions the trainer keeps in flight")
    ap.add_argument("--fault-at", type=float, default=10.0, help="seconds into the run")
    ap.add_argument("--drain-timeout", type=float, default=120.0,
                    help="seconds after the load ends to wait for every result")
    ap.add_argument("--time-scale", type=float, default=5.0, help="engines' simulated s per wall s")
    ap.add_argument("--kv-tokens", type=int, default=60_000, help="KV tokens per engine")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--keep-logs", action="store_true", help="keep each run's process logs")
    args = ap.parse_args()
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        ap.error(f"--faults: unknown {', '.join(unknown)}; known: {', '.join(FAULTS)}")
    rows = []
    for fault in faults:
        print(f"chaos: {fault} ...", file=sys.stderr, flush=True)
        row = run_fault(fault, args, args.keep_logs)
        rows.append(row)
        print(f"chaos: {fault}: {row.done_once} done once, {row.lost} lost, {row.duplicated} "
              f"duplicated, {row.failed_infra} failed (infra), {row.wasted_finishes} wasted, "
              f"recovery {row.recovery_s} s, {row.wall_s} s" +
              "".join(f"\n  {n}" for n in row.notes), file=sys.stderr, flush=True)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_until_interrupted(main, "chaos"))
