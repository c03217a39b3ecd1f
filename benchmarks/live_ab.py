"""Live A/B: the broker against the real vLLM Router on the same engines, simulated or real.

    python3 benchmarks/live_ab.py --engines 4 --profile h100-8b --kv-tokens 60000 --time-scale 1 \\
        --scenario scenarios/demo.yaml --inflight 256,512 --duration 180 --warmup 60 --repeats 2 \\
        --policies misa_t,least_loaded --json out.json

    python3 benchmarks/live_ab.py --engine 'vllm:/tmp/rb-tiny/step-0 --block-size 32 \\
        --enforce-eager --num-gpu-blocks-override 160' --engines 2 \\
        --scenario scenarios/cpu-tiny.yaml --duration 120 --warmup 30 --repeats 2

For each `--inflight` bound, each repeat runs the paths one after the other (router,
broker:POLICY for each of `--policies`, then the next repeat), so drift of the machine over time
hits every path alike. Every run starts from nothing and stops everything it started (by
process group; also on Ctrl-C, SIGTERM and errors):

- fresh simulated engines, `rollout-broker sim-engine --profile --kv-tokens --time-scale --seed i`,
  one process group each; or, with `--engine 'vllm:MODEL ARGS...'`, real vLLM engines started
  as a worker starts them (`workers.engine.vllm_command`, with the dev mode the workers need),
  each warmed up with a few requests before the clock starts; on vLLM's CPU build each is
  bound to a core of its own (`VLLM_CPU_OMP_THREADS_BIND`) while cores last. Real engines
  ignore `sim_output_len`: outputs end where the model puts its end-of-sequence token or at the
  workload's cap, the same on both paths (`--time-scale` then applies to the tools only);
- `router`: `vllm-router --policy cache_aware --worker-urls <engines>` (router defaults
  otherwise; only its ports and `--log-level warning` are set). The trainer is this process
  and `--router-trainers` child processes (default: one per engine, as the broker path runs a
  worker per engine). This process hands each whole group to the child with the fewest
  sessions in flight; a child runs them with `workers.runner.SessionRunner` pointed at the
  router, as asyncio tasks on its own `httpx.AsyncClient`, tools and rewards inline
  (`InlineExecutor` on the registry `load_registry()` builds): the turns, tool waits,
  observation tokens and `sim_output_len` are exactly what a worker would send. (Until
  2026-12-02 this process ran every session itself: at 512 in flight it used 0.80–0.95 of a
  core and the router's engines sat at 31–48% KV, so the router path measured the trainer, not
  the router: docs/results/misa-t.md §1c.)
- `broker:POLICY`: a private Redis, `rollout-broker broker --policy POLICY`, one
  `rollout-broker worker --engine attach:URL --time-scale X` per engine; this process is the
  trainer, a `RolloutClient` that enqueues and reads results.

Both paths get the same session sequence with the same true lengths: groups drawn from the
scenario's source (`GeneratedSource`, seeded by the scenario, or `--seed`) with their truth in
metadata (`sim.workloads.truth.with_truth`), the workload of each next group chosen as the demo
trainer does (the one furthest below its target share of what was enqueued). The trainer keeps
`inflight` sessions in flight as whole groups (closed loop: a group is enqueued when it fits
under the bound, as results come back).

Metrics, for the first `--warmup` seconds and for the rest of the run apart:
sessions finished per second (failed ones are counted apart); generated tokens per second from
the engines' own /metrics (`vllm:generation_tokens_total` deltas summed over engines, scraped at
the window boundaries); preemptions (`vllm:num_preemptions_total` delta); prefix-cache hit rate
(delta hits / delta queries); mean KV usage (`vllm:kv_cache_usage_perc` of each engine sampled
every second, mean over engines and samples); mean waiting requests per engine; mixture drift
(finished sessions in completion order cut into batches of the scenario's `trainer.batch_size`,
`broker.mixture.mixture_drift` against its mixture, averaged over the batches that end in the
window); and, for each broker run, its ratio to the mean of the router runs at the same bound
(sessions/s and tokens/s, each window). Rates are per wall second (at `--time-scale X` the
engines run X simulated seconds per wall second). The JSON also has, per run: start-up and stop
seconds, failures with their first distinct reasons, the tokens the trainer received, CPU
cores used by each kind of process, and for the router its own routing counters.

Token-id prompts and the router: `SessionRunner` sends each turn as vLLM's token-in, token-out
`POST /inference/v1/generate`, on both paths. vLLM Router 0.1.17 proxies that endpoint and
routes it by its token ids, as it does completions' token-id prompts: its /metrics counts them
as `vllm_router_kv_routing_inputs_total{result="token_ids"}` and its cache_aware tree reports
`prefix_hit` decisions for them (`vllm_router_prefix_routing_decisions_total`), and the engines
behind it see prefix-cache hits (checked 2026-12-06 with 0.1.17 on two simulated engines: 6
token-id prompts sent 3 times each, through either endpoint, took 12 prefix-hit and 6 miss
decisions, every repeat hit the engine's cache). Each router run also checks that the router
passes the generate request through, and on simulated engines `sim_output_len` with it (a probe
request before the clock starts); it stops with an error if not. The router's counters
per window are in the JSON (`router`), and the table's note line shows its prefix-hit share.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from broker.binaries import find_executable
from broker.client import RolloutClient
from rollout_broker.demo import terminate_on_sigterm
from broker.keys import Keys
from broker.mixture import mixture_drift
from broker.policies import policy_names
from broker.redis_server import RedisHandle, free_port, start_private_redis
from broker.session import Session, SessionState
from sim.workloads.truth import with_truth
from workers.engine import (
    NO_VLLM,
    VLLM_ENV,
    EngineInfo,
    EngineScrape,
    EngineSpec,
    installed_vllm,
    model_vocabulary,
    parse_metrics,
    read_engine_info,
    vllm_command,
)

NAMESPACE = "liveab"
WINDOWS = ("warm-up", "steady")
READY_TIMEOUT_S = 120.0
VLLM_READY_TIMEOUT_S = 600.0  # a real engine loads its model first
STOP_GRACE_S = 10.0
PROGRESS_EVERY_S = 10.0


class Fatal(RuntimeError):
    """A run cannot go on (a process died, a check failed); the message says why."""


# -- options ------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Live A/B of the broker against vLLM Router (cache_aware) on simulated engines.")
    p.add_argument("--engines", type=int, default=4, help="engines per run")
    p.add_argument("--engine", default="sim",
                   help="sim (simulated engines) or 'vllm:MODEL ARGS...' (real vLLM, as a worker "
                        "starts it; the vllm-cpu extra on a machine without a GPU)")
    p.add_argument("--profile", default=None, help="engine profile (default: the scenario's)")
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="KV tokens per engine (default: the scenario's, else the profile's)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="simulated seconds per wall second (engines and tools)")
    p.add_argument("--scenario", default=str(ROOT / "scenarios" / "demo.yaml"))
    p.add_argument("--seed", type=int, default=None, help="override the scenario's seed")
    p.add_argument("--inflight", default=None,
                   help="comma-separated in-flight bounds (default: the scenario's)")
    p.add_argument("--duration", type=float, default=180.0, help="seconds per run, warm-up included")
    p.add_argument("--warmup", type=float, default=60.0, help="first seconds reported apart")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--policies", default="misa_t,least_loaded", help="broker policies, comma-separated")
    p.add_argument("--router-trainers", type=int, default=None,
                   help="router path: processes that run its sessions (default: one per engine, "
                        "as the broker path has a worker per engine)")
    p.add_argument("--json", dest="json_out", default=None, help="write every run's metrics here")
    p.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    return p.parse_args(argv)


@dataclass
class Plan:
    args: argparse.Namespace
    scenario: object
    profile: str
    kv_tokens: int | None
    bounds: list[int]
    policies: list[str]
    router_exe: str
    vllm: EngineSpec | None = None  # real engines: the model and its arguments

    @property
    def engine_label(self) -> str:
        if self.vllm is not None:
            return f"vLLM {Path(self.vllm.target).name} {' '.join(self.vllm.args)}".strip()
        return f"{self.profile}, {self.kv_tokens or 'profile'} KV tokens"


def plan(args: argparse.Namespace) -> Plan:
    """Validate the options; raises SystemExit with a one-line error naming the option."""
    from sim.engine.profiles import get_profile
    from sim.scenario import ScenarioError, load_scenario

    def fail(msg: str) -> None:
        raise SystemExit(f"live_ab: error: {msg}")

    if args.engines < 1:
        fail(f"--engines {args.engines}: must be ≥ 1")
    if args.repeats < 1:
        fail(f"--repeats {args.repeats}: must be ≥ 1")
    if args.router_trainers is None:
        args.router_trainers = args.engines
    if args.router_trainers < 1:
        fail(f"--router-trainers {args.router_trainers}: must be ≥ 1")
    if not (math.isfinite(args.time_scale) and args.time_scale > 0):
        fail(f"--time-scale {args.time_scale:g}: must be > 0")
    if not (math.isfinite(args.duration) and args.duration > 0):
        fail(f"--duration {args.duration:g}: must be > 0")
    if not (math.isfinite(args.warmup) and args.warmup > 0):
        fail(f"--warmup {args.warmup:g}: must be > 0")
    if args.warmup >= args.duration:
        fail(f"--warmup {args.warmup:g} must be shorter than --duration {args.duration:g} "
             "(the run must outlast its warm-up)")
    if args.kv_tokens is not None and args.kv_tokens < 1:
        fail(f"--kv-tokens {args.kv_tokens}: must be ≥ 1")
    try:
        scenario = load_scenario(args.scenario)
    except ScenarioError as exc:
        fail(f"--scenario: {str(exc).splitlines()[0]}")
    if args.seed is not None:
        if args.seed < 0:
            fail(f"--seed {args.seed}: must be ≥ 0")
        scenario = scenario.model_copy(update={"seed": args.seed})
    profile = args.profile or scenario.fleet.profile
    try:
        prof = get_profile(profile)
    except ValueError as exc:
        fail(f"--profile: {exc}".replace("profile: ", "", 1))
    vllm = None
    if args.engine != "sim":
        try:
            vllm = EngineSpec.parse(args.engine)
        except ValueError as exc:
            fail(f"--engine: {exc}")
        if vllm.kind != "vllm":
            fail(f"--engine {args.engine!r}: must be sim or 'vllm:MODEL ARGS...'")
        if installed_vllm() is None:
            fail(f"--engine: {NO_VLLM}")
        vocab = model_vocabulary(vllm.target)
        if vocab is not None and scenario.vocab_size > vocab:
            fail(f"--scenario: its vocab_size ({scenario.vocab_size}) is larger than the "
                 f"model's vocabulary ({vocab}); use a scenario of that vocabulary "
                 "(scenarios/cpu-tiny.yaml for the tiny model)")
    elif scenario.vocab_size > prof.vocab_size:
        fail(f"--profile {profile}: its vocabulary ({prof.vocab_size}) is smaller than the "
             f"scenario's vocab_size ({scenario.vocab_size})")
    known = policy_names()
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    if not policies:
        fail("--policies: give at least one broker policy")
    for pol in policies:
        if pol not in known:
            fail(f"--policies: unknown policy {pol!r}; known: {', '.join(known)}")
    if len(set(policies)) != len(policies):
        fail(f"--policies: {args.policies!r} names a policy twice")
    biggest = max((w.group_size for w in scenario.workloads.values()), default=1)
    try:
        bounds = ([int(x) for x in args.inflight.split(",") if x.strip()] if args.inflight
                  else [scenario.trainer.inflight_bound])
    except ValueError:
        fail(f"--inflight {args.inflight!r}: must be comma-separated whole numbers")
    if not bounds:
        fail("--inflight: give at least one bound")
    for b in bounds:
        if b < biggest:
            fail(f"--inflight {b}: must be ≥ the scenario's largest group ({biggest}), "
                 "or no group could ever be enqueued")
    router = find_executable("vllm-router")
    if router is None:
        fail("vllm-router: no such program beside this Python or on PATH "
             "(pip install vllm-router==0.1.17)")
    kv = args.kv_tokens or scenario.fleet.kv_tokens
    return Plan(args, scenario, profile, kv, bounds, policies, router, vllm)


# -- processes ----------------------------------------------------------------------------------

class Procs:
    """The processes of one run, each the leader of a process group of its own."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: dict[str, subprocess.Popen] = {}
        self.roles: dict[str, str] = {}

    def start(self, name: str, role: str, argv: list[str],
              env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(self.logdir / f"{name}.log", "ab") as log:
            p = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True,
                                 env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))
        self.procs[name] = p
        self.roles[name] = role
        return p

    def check(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise Fatal(f"{name} exited with code {p.returncode}:\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 12) -> str:
        try:
            text = (self.logdir / f"{name}.log").read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        for p in self.procs.values():
            _killpg(p, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        stubborn = [n for n, p in self.procs.items() if p.poll() is None]
        for p in self.procs.values():  # the whole group: anything a leader left behind
            _killpg(p, signal.SIGKILL)
            if p.poll() is None:
                p.wait()
        if stubborn:
            print(f"    killed after {STOP_GRACE_S:g}s without exit on SIGTERM: "
                  f"{', '.join(stubborn)}", flush=True)


def _killpg(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_by_group() -> dict[int, float]:
    """CPU seconds used so far by the live processes of each process group."""
    out: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                text = f.read()
        except OSError:
            continue
        rest = text[text.rfind(")") + 2:].split()
        pgrp, ticks = int(rest[2]), int(rest[11]) + int(rest[12])
        out[pgrp] = out.get(pgrp, 0.0) + ticks / _TICK
    return out


def pid_cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read()
    except OSError:
        return 0.0
    rest = rest[rest.rfind(")") + 2:].split()
    return (int(rest[11]) + int(rest[12])) / _TICK


def wait_http(urls: list[str], procs: Procs, timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    left = list(urls)
    with httpx.Client(timeout=2.0) as http:
        while left:
            procs.check()
            try:
                if http.get(left[0]).status_code == 200:
                    left.pop(0)
                    continue
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise Fatal(f"{left[0]} did not answer 200 within {timeout_s:.0f}s")
            time.sleep(0.05)


def start_engines(pl: Plan, procs: Procs) -> list[str]:
    a = pl.args
    if pl.vllm is not None:
        return start_vllm_engines(pl, procs)
    urls = []
    for i in range(a.engines):
        port = free_port()
        argv = [sys.executable, "-m", "rollout_broker.cli", "sim-engine", "--host", "127.0.0.1",
                "--port", str(port), "--profile", pl.profile, "--time-scale", repr(a.time_scale),
                "--seed", str(i)]
        if pl.kv_tokens:
            argv += ["--kv-tokens", str(pl.kv_tokens)]
        procs.start(f"engine-{i}", "engines", argv)
        urls.append(f"http://127.0.0.1:{port}")
    wait_http([f"{u}/health" for u in urls], procs)
    return urls


def start_vllm_engines(pl: Plan, procs: Procs) -> list[str]:
    """Real vLLM engines, each as a worker would start it; warmed up before the clock starts
    (a CPU engine compiles kernels for each new batch shape on its first requests)."""
    spec, install = pl.vllm, installed_vllm()
    cores = os.cpu_count() or 1
    urls = []
    for i in range(pl.args.engines):
        port = free_port()
        env = dict(VLLM_ENV)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        if install.cpu_build and pl.args.engines <= cores:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(i % cores)  # a core of its own
        procs.start(f"engine-{i}", "engines", vllm_command(spec.target, port, spec.args, install),
                    env=env)
        urls.append(f"http://127.0.0.1:{port}")
    wait_http([f"{u}/health" for u in urls], procs, timeout_s=VLLM_READY_TIMEOUT_S)
    info = read_engine_info(urls[0])
    with httpx.Client(timeout=120.0) as http:
        for u in urls:
            for n in (8, 64, 512):
                http.post(f"{u}/inference/v1/generate", json={
                    "model": info.model, "token_ids": list(range(3, 3 + n)),
                    "sampling_params": {"max_tokens": 16}}).raise_for_status()
    return urls


# -- the session sequence -----------------------------------------------------------------------

class Feeder:
    """The same groups in the same order on every run: the workload furthest below its share of
    what was enqueued so far goes next (the demo trainer's rule), its next group from the
    scenario's source. A group is handed out whole, when it fits under the bound."""

    def __init__(self, pl: Plan) -> None:
        from sim.workloads.source import make_source

        self.mixture = dict(pl.scenario.mixture)
        self.source = make_source(pl.scenario, pl.args.scenario)
        self.enqueued: Counter[str] = Counter()
        self._next: list[Session] | None = None
        self.exhausted = False

    def take(self, room: int) -> list[Session]:
        out: list[Session] = []
        while not self.exhausted:
            if self._next is None:
                total = sum(self.enqueued.values()) or 1
                w = min(self.mixture, key=lambda w: self.enqueued[w] / total - self.mixture[w])
                group = self.source.next_group(w)
                if group is None:
                    self.exhausted = True
                    break
                self._next = [with_truth(s) for s in group]
            if len(out) + len(self._next) > room:
                break
            for s in self._next:
                self.enqueued[s.workload] += 1
            out += self._next
            self._next = None
        return out


@dataclass(slots=True)
class Finish:
    t: float  # seconds since the run's clock started
    workload: str
    ok: bool
    output_tokens: int
    error: str | None = None


# -- sampling the engines -----------------------------------------------------------------------

@dataclass
class Sample:
    nominal: float  # seconds since t0 this sample was due
    actual: float  # seconds since t0 it was taken
    engines: list[EngineScrape | None]
    router: dict[str, float] | None = None


def parse_router(text: str) -> dict[str, float]:
    """The router's routing counters: cache_aware decisions by outcome, inputs by kind."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm_router_prefix_routing_decisions_total":
                key = f"decisions_{s.labels.get('outcome', '?')}"
            elif s.name == "vllm_router_kv_routing_inputs_total":
                key = f"inputs_{s.labels.get('result', '?')}"
            else:
                continue
            out[key] = out.get(key, 0.0) + s.value
    return out


class Sampler(threading.Thread):
    """Scrapes every engine's /metrics once a second and at the window boundaries (0, warm-up,
    duration), on a thread of its own so a busy trainer does not skew the clock."""

    def __init__(self, urls: list[str], warmup: float, duration: float,
                 router_metrics: str | None = None) -> None:
        super().__init__(daemon=True, name="sampler")
        self.urls = urls
        self.t0 = 0.0
        self.boundaries = (0.0, warmup, duration)
        self.due = sorted({float(k) for k in range(int(duration) + 1)} | set(self.boundaries))
        self.router_metrics = router_metrics
        self.samples: list[Sample] = []
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self._http = httpx.Client(timeout=5.0)
        self._pool = ThreadPoolExecutor(max_workers=len(urls) + 1)

    def begin(self) -> float:
        """Start the clock: the first sample is taken here, before any session is sent; the
        thread takes the rest. Returns t0 (time.monotonic)."""
        self.t0 = time.monotonic()
        self.samples.append(self._take(self.due[0], tries=3, router=True))
        self.start()
        return self.t0

    def run(self) -> None:
        try:
            for due in self.due[1:]:
                wait = self.t0 + due - time.monotonic()
                if wait > 0 and self.stop_event.wait(wait):
                    return
                boundary = due in self.boundaries
                self.samples.append(self._take(due, tries=3 if boundary else 1, router=boundary))
        except BaseException as exc:
            self.error = exc
        finally:
            self._pool.shutdown(wait=False)
            self._http.close()

    def _take(self, due: float, tries: int, router: bool) -> Sample:
        http, pool = self._http, self._pool

        def scrape(url: str) -> EngineScrape | None:
            for _ in range(tries):
                try:
                    return parse_metrics(http.get(f"{url}/metrics").raise_for_status().text)
                except (httpx.HTTPError, ValueError):
                    continue
            return None

        def scrape_router() -> dict[str, float] | None:
            if not (router and self.router_metrics):
                return None
            try:
                return parse_router(http.get(self.router_metrics).raise_for_status().text)
            except (httpx.HTTPError, ValueError):
                return None

        taken = time.monotonic() - self.t0
        rf = pool.submit(scrape_router)
        engines = list(pool.map(scrape, self.urls))
        return Sample(nominal=due, actual=taken, engines=engines, router=rf.result())


# -- one run's trainers -------------------------------------------------------------------------

@dataclass
class RunState:
    label: str
    duration: float
    warmup: float
    bound: int
    started: int = 0
    finishes: list[Finish] = field(default_factory=list)
    _last_progress: float = 0.0

    @property
    def in_flight(self) -> int:
        return self.started - len(self.finishes)

    def progress(self, elapsed: float, force: bool = False) -> None:
        if not force and elapsed - self._last_progress < PROGRESS_EVERY_S:
            return
        recent = [f for f in self.finishes if f.t > elapsed - PROGRESS_EVERY_S]
        span = min(PROGRESS_EVERY_S, max(elapsed, 1e-9))
        window = WINDOWS[0] if elapsed < self.warmup else WINDOWS[1]
        failed = sum(not f.ok for f in self.finishes)
        print(f"    [{self.label}] {elapsed:6.1f}/{self.duration:.0f}s {window:7s} "
              f"finished {len(self.finishes):6d} (failed {failed}) in flight {self.in_flight:4d} "
              f"last {span:.0f}s: {len(recent) / span:6.2f} sess/s", flush=True)
        self._last_progress = elapsed


def probe_router(router_url: str, model: str, simulated: bool) -> None:
    """One request through the router, as a turn is sent (`/inference/v1/generate`): it must
    answer and, on simulated engines, pass `sim_output_len` through, or the router path would
    not run the sessions' true lengths."""
    body = {"model": model, "token_ids": [1, 2, 3, 4],
            "sampling_params": {"max_tokens": 5, "extra_args": {"sim_output_len": 3}}}
    r = httpx.post(f"{router_url}/inference/v1/generate", json=body, timeout=60.0)
    if r.status_code != 200:
        raise Fatal(f"router probe: HTTP {r.status_code}: {r.text[:200]}")
    n = len(r.json()["choices"][0].get("token_ids") or [])
    if simulated and n != 3:
        raise Fatal(f"router probe: asked sim_output_len 3, got {n} tokens: the router does not "
                    "pass sim_output_len through, so the router path cannot replay true lengths")


def router_child(index: int, router_url: str, info: EngineInfo, time_scale: float, inbox,
                 outbox) -> None:
    """Process `index` of the router path's trainer: runs each session it is handed on the
    router with `workers.runner.SessionRunner` (tools and rewards inline), and reports each
    finish as (index, time.monotonic(), workload, ok, output tokens, error); at the end (None
    in its inbox) it cancels what still runs and reports ("cpu", its CPU seconds)."""
    asyncio.run(_router_child(index, router_url, info, time_scale, inbox, outbox))


async def _router_child(index: int, router_url: str, info: EngineInfo, time_scale: float,
                        inbox, outbox) -> None:
    from workers.engine_http import engine_client
    from workers.runner import EngineUnavailable, RunnerSettings, SessionRunner
    from workers.tools import InlineExecutor, load_registry

    loop = asyncio.get_running_loop()
    settings = RunnerSettings(time_scale=time_scale)
    # The workers' client (one connection per session in flight): the arms differ by the
    # policy, not by the HTTP stack.
    async with engine_client(settings.request_timeout_s) as http:
        runner = SessionRunner(http, router_url, info.model, info.max_model_len,
                               InlineExecutor(registry=load_registry()), settings,
                               vocab_size=info.vocab_size)

        async def one(s: Session) -> None:
            try:
                r = (await runner.run(s)).result
                done = (index, time.monotonic(), s.workload, r.status == SessionState.done,
                        r.output_tokens, r.error)
            except EngineUnavailable as exc:  # a worker would hand it back; we count it failed
                done = (index, time.monotonic(), s.workload, False, 0, f"unavailable: {exc}")
            except Exception as exc:  # the tool service, or anything else: failed, with why
                done = (index, time.monotonic(), s.workload, False, 0,
                        f"{type(exc).__name__}: {exc}")
            outbox.put(done)

        tasks: set[asyncio.Task] = set()
        outbox.put(("ready",))
        try:
            while (batch := await loop.run_in_executor(None, inbox.get)) is not None:
                for s in batch:
                    t = asyncio.create_task(one(s))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
        finally:
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    outbox.put(("cpu", time.process_time()))


def router_trainer(pl: Plan, router_url: str, info: EngineInfo, state: RunState,
                   procs: Procs, sampler: Sampler) -> float:
    """The router path's trainer: this process feeds whole groups, under the bound, to
    `--router-trainers` child processes (each to the one with the fewest sessions in flight),
    which run them on the router; one Python process with hundreds of sessions in flight
    saturates its core on this machine, which would cap the router path below what the router
    and the engines can do. Returns the children's CPU seconds."""
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(pl.args.router_trainers)]
    children = [ctx.Process(target=router_child, daemon=True, name=f"router-trainer-{i}",
                            args=(i, router_url, info, pl.args.time_scale, q, outbox))
                for i, q in enumerate(inboxes)]
    for c in children:
        c.start()
    ready, deadline = 0, time.monotonic() + READY_TIMEOUT_S
    while ready < len(children):
        try:
            if outbox.get(timeout=1.0)[0] == "ready":
                ready += 1
        except queue.Empty:
            dead = [c.name for c in children if not c.is_alive()]
            if dead or time.monotonic() > deadline:
                raise Fatal(f"router trainers: {', '.join(dead) or 'some'} not ready "
                            f"({'exited' if dead else f'after {READY_TIMEOUT_S:.0f}s'})") from None
    feeder = Feeder(pl)
    loads = [0] * len(children)  # sessions in flight per child
    cpu = 0.0
    t0 = sampler.begin()
    try:
        last_check = 0.0
        while (elapsed := time.monotonic() - t0) < state.duration:
            batch = feeder.take(state.bound - state.in_flight)
            groups: dict[str, list[Session]] = {}
            for s in batch:  # whole groups to one child (as the broker admits them together)
                groups.setdefault(s.group_id or s.session_id, []).append(s)
            for group in groups.values():
                i = min(range(len(children)), key=loads.__getitem__)
                loads[i] += len(group)
                inboxes[i].put(group)
                state.started += len(group)
            try:
                msg = outbox.get(timeout=min(0.05, max(0.001, state.duration - elapsed)))
            except queue.Empty:
                msg = None
            while msg is not None:
                i, at, workload, ok, tokens, error = msg
                loads[i] -= 1
                state.finishes.append(Finish(at - t0, workload, ok, tokens, error))
                try:
                    msg = outbox.get_nowait()
                except queue.Empty:
                    msg = None
            if elapsed - last_check >= 1.0:
                procs.check()
                dead = [c.name for c in children if not c.is_alive()]
                if dead:
                    raise Fatal(f"router trainer process died: {', '.join(dead)}")
                last_check = elapsed
            state.progress(elapsed)
        # the end sample is due now: let the sampler take it before anything stops
        sampler.join(30.0)
    finally:
        for q in inboxes:
            q.put(None)
        deadline = time.monotonic() + STOP_GRACE_S
        ended = 0
        while ended < len(children) and time.monotonic() < deadline:
            try:
                msg = outbox.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if msg[0] == "cpu":
                cpu += msg[1]
                ended += 1
        for c in children:
            c.join(timeout=1.0)
            if c.is_alive():
                c.kill()
    return cpu


def broker_trainer(pl: Plan, state: RunState, procs: Procs, sampler: Sampler,
                   client: RolloutClient) -> None:
    feeder = Feeder(pl)
    t0 = sampler.begin()
    last_check = 0.0
    while (elapsed := time.monotonic() - t0) < state.duration:
        batch = feeder.take(state.bound - state.in_flight)
        if batch:
            client.enqueue(batch)
            state.started += len(batch)
        got = client.results(state.bound, timeout=min(0.05, max(0.001, state.duration - elapsed)))
        now = time.monotonic() - t0
        for r in got:
            state.finishes.append(Finish(now, r.workload, r.status == SessionState.done,
                                         r.output_tokens, r.error))
        if elapsed - last_check >= 1.0:
            procs.check()
            last_check = elapsed
        state.progress(elapsed)
    sampler.join(30.0)


# -- one run ------------------------------------------------------------------------------------

@dataclass
class RunRecord:
    path: str  # router | broker:POLICY
    inflight: int
    repeat: int
    startup_s: float = 0.0
    engines_ready_s: float = 0.0
    stop_s: float = 0.0
    enqueued: int = 0
    finished: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    cpu_cores: dict[str, float] = field(default_factory=dict)
    windows: dict[str, dict] = field(default_factory=dict)
    logdir: str = ""


def run_once(pl: Plan, path: str, bound: int, repeat: int, logroot: Path) -> RunRecord:
    a = pl.args
    rec = RunRecord(path=path, inflight=bound, repeat=repeat)
    logdir = logroot / f"inflight{bound}-rep{repeat}-{path.replace(':', '-')}"
    logdir.mkdir(parents=True)
    rec.logdir = str(logdir)
    procs = Procs(logdir)
    redis_handle: RedisHandle | None = None
    client: RolloutClient | None = None
    label = f"inflight {bound} · rep {repeat} · {path}"
    state = RunState(label, a.duration, a.warmup, bound)
    sampler: Sampler | None = None
    began = time.monotonic()
    try:
        urls = start_engines(pl, procs)
        rec.engines_ready_s = round(time.monotonic() - began, 2)
        router_metrics = None
        if path == "router":
            port, prom = free_port(), free_port()
            procs.start("router", "router", [
                pl.router_exe, "--host", "127.0.0.1", "--port", str(port),
                "--policy", "cache_aware", "--worker-urls", *urls,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
                "--log-level", "warning"])
            router_url = f"http://127.0.0.1:{port}"
            router_metrics = f"http://127.0.0.1:{prom}/metrics"
            wait_http([f"{router_url}/health", f"{router_url}/v1/models"], procs)
            info = read_engine_info(urls[0])
            probe_router(router_url, info.model, simulated=pl.vllm is None)
        else:
            policy = path.split(":", 1)[1]
            redis_handle = start_private_redis()
            common = ["--redis-url", redis_handle.url, "--namespace", NAMESPACE,
                      "--log-level", "WARNING"]
            cli = [sys.executable, "-m", "rollout_broker.cli"]
            procs.start("broker", "broker", [*cli, "broker", "--policy", policy, "--lease-s", "2",
                                             *common])
            for i, u in enumerate(urls):
                procs.start(f"worker-{i}", "workers", [
                    *cli, "worker", "--backend-id", f"engine-{i}", "--engine", f"attach:{u}",
                    "--time-scale", repr(a.time_scale), "--drain-grace", "1", *common])
            client = RolloutClient(redis_handle.url, NAMESPACE)
            client.set_mixture(pl.scenario.mixture)
            wait_broker_ready(client, redis_handle.url, procs, len(urls))
        rec.startup_s = round(time.monotonic() - began, 2)
        print(f"    [{label}] ready in {rec.startup_s:.1f}s (engines {rec.engines_ready_s:.1f}s)",
              flush=True)

        groups = {name: p.pid for name, p in procs.procs.items()}
        cpu0 = cpu_by_group()
        redis0 = pid_cpu(redis_handle.process.pid) if redis_handle and redis_handle.process else 0.0
        me0 = time.process_time()
        sampler = Sampler(urls, a.warmup, a.duration, router_metrics)
        children_cpu = 0.0
        if path == "router":
            children_cpu = router_trainer(pl, router_url, info, state, procs, sampler)
        else:
            assert client is not None
            broker_trainer(pl, state, procs, sampler, client)
        t0 = sampler.t0
        wall = time.monotonic() - t0
        cpu1 = cpu_by_group()
        cores: dict[str, float] = {"trainer (this process)": (time.process_time() - me0) / wall}
        if path == "router":  # (from their start, which is before the clock: an overestimate)
            cores["router trainers"] = children_cpu / wall
        for name, pgid in groups.items():
            role = procs.roles[name]
            cores[role] = cores.get(role, 0.0) + (cpu1.get(pgid, 0.0) - cpu0.get(pgid, 0.0)) / wall
        if redis_handle and redis_handle.process:
            cores["redis"] = (pid_cpu(redis_handle.process.pid) - redis0) / wall
        rec.cpu_cores = {k: round(v, 3) for k, v in cores.items()}
        if sampler.error is not None:
            raise Fatal(f"sampler: {type(sampler.error).__name__}: {sampler.error}")
        state.progress(time.monotonic() - t0, force=True)
        rec.enqueued = state.started
        rec.finished = sum(f.ok for f in state.finishes)
        rec.failed = sum(not f.ok for f in state.finishes)
        rec.errors = list(dict.fromkeys(f.error or "?" for f in state.finishes if not f.ok))[:5]
        rec.windows = measure(pl, sampler.samples, state.finishes)
        return rec
    finally:
        stop_began = time.monotonic()
        if sampler is not None:
            sampler.stop_event.set()
        if client is not None:
            try:
                client.close()
            except Exception:  # Redis may be gone already; nothing to keep
                pass
        procs.stop()
        if redis_handle is not None:
            redis_handle.close()
        rec.stop_s = round(time.monotonic() - stop_began, 2)


def wait_broker_ready(client: RolloutClient, redis_url: str, procs: Procs, n: int) -> None:
    import redis

    r = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while True:
            procs.check()
            backends = client.status()["backends"]
            if (r.exists(Keys(NAMESPACE).lease) and
                    sum(1 for b in backends.values() if b["healthy"]) >= n):
                return
            if time.monotonic() > deadline:
                raise Fatal(f"broker and {n} workers not ready within {READY_TIMEOUT_S:.0f}s")
            time.sleep(0.1)
    finally:
        r.close()


# -- metrics ------------------------------------------------------------------------------------

def _boundary(samples: list[Sample], at: float) -> Sample | None:
    for s in samples:
        if s.nominal == at:
            return s
    return None


def _delta(a: Sample, b: Sample, get) -> float | None:
    """Σ over engines of get(b) − get(a); None if any engine's scrape is missing."""
    total = 0.0
    for x, y in zip(a.engines, b.engines):
        if x is None or y is None:
            return None
        total += get(y) - get(x)
    return total


def measure(pl: Plan, samples: list[Sample], finishes: list[Finish]) -> dict[str, dict]:
    a = pl.args
    mixture = dict(pl.scenario.mixture)
    size = pl.scenario.trainer.batch_size
    batches: list[tuple[float, float]] = []  # (time the batch completed, its drift)
    ordered = sorted(finishes, key=lambda f: f.t)
    for i in range(0, len(ordered) - size + 1, size):
        chunk = ordered[i:i + size]
        batches.append((chunk[-1].t, mixture_drift(Counter(f.workload for f in chunk), mixture)))
    out: dict[str, dict] = {}
    for name, (w0, w1) in zip(WINDOWS, ((0.0, a.warmup), (a.warmup, a.duration))):
        span = w1 - w0
        mine = [f for f in finishes if w0 <= f.t < w1]
        ok = [f for f in mine if f.ok]
        m: dict = {"from_s": w0, "to_s": w1, "sessions": len(ok),
                   "failed": len(mine) - len(ok), "sess_s": len(ok) / span,
                   "client_tok_s": sum(f.output_tokens for f in mine) / span,
                   "by_workload": dict(Counter(f.workload for f in ok))}
        s0, s1 = _boundary(samples, w0), _boundary(samples, w1)
        if s0 is not None and s1 is not None:
            gen = _delta(s0, s1, lambda e: e.generation_tokens_total)
            m["tok_s"] = gen / max(1e-9, s1.actual - s0.actual) if gen is not None else None
            m["generated_tokens"] = gen
            pre = _delta(s0, s1, lambda e: e.metrics.preemptions_total)
            m["preemptions"] = int(pre) if pre is not None else None
            hits = _delta(s0, s1, lambda e: e.metrics.prefix_hits_total)
            queries = _delta(s0, s1, lambda e: e.metrics.prefix_queries_total)
            m["prefix_hits"], m["prefix_queries"] = hits, queries
            m["prefix_hit"] = hits / queries if hits is not None and queries else None
            if s0.router is not None and s1.router is not None:
                keys = set(s0.router) | set(s1.router)
                m["router"] = {k: s1.router.get(k, 0.0) - s0.router.get(k, 0.0) for k in sorted(keys)}
                hit, miss = m["router"].get("decisions_prefix_hit", 0.0), \
                    m["router"].get("decisions_prefix_miss", 0.0)
                m["router_prefix_hit_share"] = hit / (hit + miss) if hit + miss else None
        else:
            m.update(tok_s=None, generated_tokens=None, preemptions=None, prefix_hit=None)
        inside = [s for s in samples if w0 <= s.nominal < w1]
        kv = [e.metrics.kv_usage for s in inside for e in s.engines if e is not None]
        waiting = [e.metrics.waiting for s in inside for e in s.engines if e is not None]
        running = [e.metrics.running for s in inside for e in s.engines if e is not None]
        m["kv_use"] = statistics.fmean(kv) if kv else None
        m["waiting"] = statistics.fmean(waiting) if waiting else None
        m["running"] = statistics.fmean(running) if running else None
        m["samples"] = len(inside)
        drifts = [d for t, d in batches if w0 <= t < w1]
        m["drift"] = statistics.fmean(drifts) if drifts else None
        m["batches"] = len(drifts)
        out[name] = m
    return out


def add_ratios(records: list[RunRecord]) -> None:
    """Each run's sessions/s and tok/s over the mean of the router runs at its bound."""
    for bound in {r.inflight for r in records}:
        mine = [r for r in records if r.inflight == bound]
        routers = [r for r in mine if r.path == "router"]
        for w in WINDOWS:
            for key in ("sess_s", "tok_s"):
                vals = [r.windows[w].get(key) for r in routers]
                vals = [v for v in vals if v is not None]
                ref = statistics.fmean(vals) if vals else None
                for r in mine:
                    v = r.windows[w].get(key)
                    r.windows[w][f"{key}_vs_router"] = (v / ref if ref and v is not None
                                                       and r.path != "router" else None)
                    r.windows[w][f"router_mean_{key}"] = ref


# -- output -------------------------------------------------------------------------------------

def _f(v, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def table(records: list[RunRecord], bound: int, pl: Plan) -> str:
    a = pl.args
    lines = [(f"### inflight {bound}: {a.engines} × {pl.engine_label}, "
              f"×{a.time_scale:g}, {a.duration:g}s runs (warm-up {a.warmup:g}s), per wall "
              "second; ratio = sess/s / tok/s over the mean of the router runs"), "",
             ("| path | rep | window | sess/s | tok/s | ratio vs router | preempt | prefix hit "
              "| KV use | waiting | drift |"),
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for r in [r for r in records if r.inflight == bound]:
        for w in WINDOWS:
            m = r.windows[w]
            ratio = ("—" if m.get("sess_s_vs_router") is None else
                     f"{_f(m.get('sess_s_vs_router'), '.2f')} / {_f(m.get('tok_s_vs_router'), '.2f')}")
            lines.append(
                f"| {r.path} | {r.repeat} | {w} | {m['sess_s']:.2f} | {_f(m.get('tok_s'), ',.0f')} "
                f"| {ratio} | {_f(m.get('preemptions'), 'd')} | {_f(m.get('prefix_hit'), '.1%')} "
                f"| {_f(m.get('kv_use'), '.1%')} | {_f(m.get('waiting'), '.1f')} "
                f"| {_f(m.get('drift'), '.3f')} |")
        extra = []
        if r.path == "router":
            shares = [r.windows[w].get("router_prefix_hit_share") for w in WINDOWS]
            extra.append("router cache_aware prefix-hit decisions "
                         + " / ".join(_f(s, ".0%") for s in shares) + " (warm-up / steady)")
        if r.failed:
            extra.append(f"{r.failed} failed: {r.errors[0][:160]}")
        extra.append(f"start-up {r.startup_s:.1f}s")
        busy = ", ".join(f"{k} {v:.2f}" for k, v in r.cpu_cores.items())
        extra.append(f"CPU cores: {busy}")
        notes.append(f"- {r.path} rep {r.repeat}: " + "; ".join(extra))
    return "\n".join(lines + [""] + notes)


def report(records: list[RunRecord], pl: Plan, interrupted: bool) -> None:
    add_ratios(records)
    print()
    for bound in pl.bounds:
        if any(r.inflight == bound for r in records):
            print(table(records, bound, pl))
            print()
    if pl.args.json_out:
        a = pl.args
        doc = {"settings": {"engines": a.engines, "engine": a.engine, "profile": pl.profile,
                            "kv_tokens": pl.kv_tokens,
                            "time_scale": a.time_scale, "scenario": str(a.scenario),
                            "seed": pl.scenario.seed, "inflight": pl.bounds,
                            "duration_s": a.duration, "warmup_s": a.warmup,
                            "repeats": a.repeats, "policies": pl.policies,
                            "router": pl.router_exe, "router_policy": "cache_aware",
                            "batch_size": pl.scenario.trainer.batch_size,
                            "mixture": dict(pl.scenario.mixture)},
               "complete": not interrupted,
               "runs": [asdict(r) for r in records]}
        Path(a.json_out).write_text(json.dumps(doc, indent=2))
        print(f"wrote {a.json_out}")


def main(argv: list[str] | None = None) -> int:
    pl = plan(parse_args(argv))
    a = pl.args

    terminate_on_sigterm()
    paths = ["router"] + [f"broker:{p}" for p in pl.policies]
    schedule = [(b, rep, path) for b in pl.bounds for rep in range(1, a.repeats + 1)
                for path in paths]
    logroot = Path(tempfile.mkdtemp(prefix="rb-live-ab-"))
    print(f"live A/B: {len(schedule)} runs of {a.duration:g}s on {a.engines} engines "
          f"({pl.engine_label}, ×{a.time_scale:g}); scenario {pl.scenario.name} seed "
          f"{pl.scenario.seed}; logs {logroot}", flush=True)
    records: list[RunRecord] = []
    interrupted = failed = False
    began = time.monotonic()
    try:
        for i, (bound, rep, path) in enumerate(schedule, 1):
            print(f"run {i}/{len(schedule)}: inflight {bound}, repeat {rep}, {path} "
                  f"(elapsed {time.monotonic() - began:.0f}s)", flush=True)
            records.append(run_once(pl, path, bound, rep, logroot))
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: stopped the run's processes; tables of the finished runs follow",
              flush=True)
    except Exception as exc:  # Fatal, or anything unforeseen: the run's processes are stopped
        failed = True
        what = str(exc) if isinstance(exc, Fatal) else f"{type(exc).__name__}: {exc}"
        print(f"live_ab: error: {what}\nlogs kept in {logroot}", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not skip the report
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    report(records, pl, interrupted or failed)
    if not (a.keep_logs or failed or interrupted):
        shutil.rmtree(logroot, ignore_errors=True)
    else:
        print(f"logs in {logroot}")
    return 130 if interrupted else 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
