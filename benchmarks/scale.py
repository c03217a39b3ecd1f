"""Scale figures (issue 17, item 4): the broker, Redis and the status API at production size,
and the fleet simulator's cost against engine count. One table; `--json PATH` writes them.

1. admission: a real `BrokerService` (a thread of this process, default settings) against a
   private Redis; 256 backends registered through `WorkerLink` and heartbeating at 1 Hz from one
   thread of a child process (kv_usage 0.05, 10^9 KV tokens each, so capacity never holds
   admission back; no engines, nothing runs or finishes); 50,000 pending sessions (150-token
   prompts as token ids, GRPO groups of 8, rlvr/rlhf/agentic 50/30/20) enqueued before the
   broker starts. Reported: admissions/s over the drain's steady window (10 % to 90 % of them
   admitted); decide()'s median and p99 in that window (the policy wrapped and timed on every
   call the broker makes; the window's calls are those that admitted its sessions); then 20 s
   of arrivals at 500 sessions/s (a child process enqueues them) with the 50,000 resident, and
   decide()'s median and p99 there. For misa_t (the default) and least_loaded. Targets:
   >= 5,000 sessions/s, decide() median <= 5 ms.
2. memory: Redis `used_memory` growth per pending session after enqueueing N sessions through
   `RolloutClient.enqueue`, for a 150-token and a 3,700-token prompt (token ids below 128,256),
   and MEMORY USAGE of the pending-stream entry, the session hash and the body key (the session
   stored once, compact: broker/body.py), and the stored body's length next to the full JSON's.
   Target: <= 1 KB per pending session. Then 1,000,000 pending 150-token sessions (about
   0.9 GiB of Redis; 3.2 GiB when the body was stored twice) are enqueued in batches of 5,000
   (the time is reported), 16 backends of 700k KV tokens heartbeat, and a `rollout-broker
   broker` process serves the namespace: its RSS once it has called decide() 20 times (it
   admits until the ledgers are full, then decides on every heartbeat), against the same
   command's RSS on an empty namespace.
3. status: 500 sequential keep-alive GET /v1/status against `rollout-broker api` (uvicorn, a
   child process) on that namespace, first with the broker running, then with it stopped.
   Target: p99 <= 20 ms.
4. simulator: wall seconds of one misa_t run (`FleetSim`, as `rollout-broker bench` runs each
   policy) of scenarios/demo.yaml at 8, 32 and 128 engines, with the trainer's batch_size (8 per
   engine) and inflight_bound (64 per engine) scaled with the engine count so the load per
   engine is the demo's, 30 iterations each. Reported: wall and decide() seconds per engine
   count, the least-squares slope (seconds per engine) and its R^2, and the log-log exponent
   (1 = linear; 2 = quadratic).

Every Redis figure runs on a private redis-server started here (removed at the end) unless
`--redis-url` names one; on a shared server the memory figures include everyone's traffic.
Timings on a shared 2-core machine are noisy: run it twice and compare. The full run takes about
12 minutes and 4 GiB of memory here; `--quick` (16 backends, 20,000 pending, 2-8 engines) under
a minute.

Usage: python benchmarks/scale.py [--quick] [--json PATH] [--redis-url URL]
           [--skip admission,memory,million,sim] [--policies misa_t,least_loaded]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import redis
import yaml

from broker.body import dump_body
from broker.client import RolloutClient
from rollout_broker.demo import run_until_interrupted
from broker.heartbeat import EngineMetrics
from broker.keys import Keys
from broker.policies import policy_names
from broker.policies.base import Decision, Snapshot
from broker.redis_conn import delete_namespace
from broker.redis_server import RedisHandle, free_port, start_private_redis
from broker.gc_tuning import few_collections
from broker.service import BrokerService, BrokerSettings, load_policy
from broker.session import Session
from broker.worker_link import WorkerLink

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 128_256
MIX = (("rlvr", 0.5), ("rlhf", 0.3), ("agentic", 0.2))
SHAPE: dict[str, dict[str, Any]] = {
    "rlvr": {"max_tokens": 4_096},
    "rlhf": {"max_tokens": 1_024},
    "agentic": {"max_tokens": 2_048, "max_turns": 10, "metadata": {"tool": "bench"}},
}
GROUP = 8

TARGETS = {  # figure -> (comparison, bound)
    "admission_per_s": (">=", 5_000.0),
    "decide_median_ms": ("<=", 5.0),
    "redis_bytes_per_pending": ("<=", 1_024.0),
    "status_p99_ms": ("<=", 20.0),
}


@dataclass(frozen=True)
class Config:
    backends: int = 256
    admit_n: int = 50_000
    policies: tuple[str, ...] = ("misa_t", "least_loaded")
    steady_s: float = 20.0
    steady_rate: float = 500.0
    memory_n: tuple[tuple[int, int], ...] = ((150, 20_000), (3_700, 2_000))  # prompt, sessions
    million: int = 1_000_000
    million_backends: int = 16
    status_requests: int = 500
    sim_engines: tuple[int, ...] = (8, 32, 128)
    sim_iterations: int = 30


QUICK = Config(backends=16, admit_n=3_000, steady_s=2.0, memory_n=((150, 1_000), (3_700, 200)),
               million=20_000, million_backends=4, status_requests=100, sim_engines=(2, 4, 8),
               sim_iterations=5)


# -- sessions ---------------------------------------------------------------------------------
def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(length)] for _ in range(n)]


def sessions(tag: str, start: int, stop: int, pool: list[list[int]],
             workload: str | None = None) -> list[Session]:
    """Sessions `start`..`stop` in groups of 8 sharing a prompt; workloads 50/30/20 by group
    unless `workload` is given."""
    out = []
    for i in range(start, stop):
        g = i // GROUP
        w = workload or ("rlvr" if g % 10 < 5 else "rlhf" if g % 10 < 8 else "agentic")
        out.append(Session(session_id=f"{tag}{i}", workload=w, group_id=f"{tag}g{g}",
                           group_size=GROUP, prompt_token_ids=pool[g % len(pool)], **SHAPE[w]))
    return out


def enqueue_all(client: RolloutClient, tag: str, n: int, pool: list[list[int]],
                workload: str | None = None, batch: int = 5_000) -> float:
    """Enqueue n sessions in batches; returns the seconds spent inside `enqueue` calls."""
    spent = 0.0
    for start in range(0, n, batch):
        items = sessions(tag, start, min(n, start + batch), pool, workload)
        t0 = time.perf_counter()
        client.enqueue(items)
        spent += time.perf_counter() - t0
    return spent


# -- a fleet of heartbeating backends (child process) -----------------------------------------
def beat_fleet(url: str, ns: str, backends: int, capacity: int, kv_usage: float, stop, beats
               ) -> None:
    """Register `backends` backends, then beat each once per second from this one thread."""
    links = [WorkerLink(url, ns, f"gpu-{b}", heartbeat_ttl_s=5.0) for b in range(backends)]
    for link in links:
        link.register(capacity, 32_768)
    metrics = EngineMetrics(kv_usage=kv_usage, running=0, waiting=0, preemptions_total=0,
                            prefix_queries_total=0, prefix_hits_total=0)
    next_round = time.monotonic()
    while not stop.is_set():
        for link in links:
            link.heartbeat(metrics)
        with beats.get_lock():
            beats.value += len(links)
        next_round += 1.0
        stop.wait(max(0.0, next_round - time.monotonic()))
    for link in links:
        link.close()


class Fleet:
    def __init__(self, url: str, ns: str, backends: int, capacity: int, kv_usage: float) -> None:
        ctx = mp.get_context("spawn")
        self.stop = ctx.Event()
        self.beats = ctx.Value("q", 0)
        self.url, self.ns, self.backends = url, ns, backends
        self.proc = ctx.Process(target=beat_fleet, daemon=True,
                                args=(url, ns, backends, capacity, kv_usage, self.stop, self.beats))

    def __enter__(self) -> Fleet:
        self.proc.start()
        r = redis.Redis.from_url(self.url)
        k = Keys(self.ns)
        deadline = time.monotonic() + 120
        while True:
            pipe = r.pipeline(transaction=False)
            for b in range(self.backends):
                pipe.exists(k.heartbeat(f"gpu-{b}"))
            if sum(pipe.execute()) == self.backends:
                break
            if time.monotonic() > deadline or not self.proc.is_alive():
                raise RuntimeError("the heartbeat fleet did not come up")
            time.sleep(0.1)
        r.close()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


# -- 1. admission with many backends ----------------------------------------------------------
class TimedPolicy:
    """The broker's policy, with every decide() timed; everything else passes through."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.calls: list[tuple[float, float, int]] = []  # (start, seconds, admissions)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def decide(self, snap: Snapshot) -> Decision:
        t0 = time.perf_counter()
        d = self._inner.decide(snap)
        self.calls.append((t0, time.perf_counter() - t0, len(d.admissions)))
        return d


def trickle(url: str, ns: str, rate: float, stop, sent) -> None:
    """Enqueue `rate` sessions/s (a batch every 0.1 s, whole groups) until `stop`."""
    client = RolloutClient(url, ns)
    pool = prompts(64, 150, seed=5)
    per = max(GROUP, int(rate * 0.1) // GROUP * GROUP)
    i, tick = 0, time.monotonic()
    while not stop.is_set():
        client.enqueue(sessions("t", i, i + per, pool))
        i += per
        with sent.get_lock():
            sent.value = i
        tick += per / rate
        stop.wait(max(0.0, tick - time.monotonic()))
    client.close()


def decide_stats(calls: list[tuple[float, float, int]], span: float) -> dict[str, float]:
    ms = sorted(c[1] * 1000 for c in calls) or [math.nan]
    return {"decide_median_ms": statistics.median(ms),
            "decide_p99_ms": ms[int(0.99 * (len(ms) - 1))],
            "decide_calls": len(calls),
            "admissions_per_decide": statistics.mean(c[2] for c in calls) if calls else math.nan,
            "decide_share": sum(c[1] for c in calls) / max(span, 1e-9)}


def drain_calls(calls: list[tuple[float, float, int]], lo: float,
                hi: float) -> list[tuple[float, float, int]]:
    """The decide() calls of the drain's window: those whose admissions, counted in call order,
    overlap the lo-th to hi-th admitted session, and the calls between them that admitted none.
    By count, not by clock: a drain of a few thousand can be one or two calls, each starting
    before the 10 % mark, and a window by start time would hold none."""
    out, before = [], 0
    for call in calls:
        after = before + call[2]
        if after > lo and before < hi:
            out.append(call)
        elif before >= hi:
            break
        before = after
    return out


def bench_admission(url: str, policy: str, backends: int, n: int, orphan_check_s: float,
                    steady_s: float, steady_rate: float) -> dict[str, float]:
    """Drain n pending sessions into admissions, then `steady_s` of arrivals at `steady_rate`
    sessions/s (a child process enqueues them) with the n admitted ones resident."""
    ns = f"scale{uuid.uuid4().hex[:8]}"
    pool = prompts(256, 150, seed=1)
    ctx = mp.get_context("spawn")
    with Fleet(url, ns, backends, capacity=10**9, kv_usage=0.05) as fleet:
        client = RolloutClient(url, ns)
        client.set_mixture(dict(MIX))
        enqueue_all(client, "a", n, pool)
        client.close()
        timed = TimedPolicy(load_policy(policy))
        service = BrokerService(url, ns, timed,  # type: ignore[arg-type]
                                BrokerSettings(lease_period_s=5, orphan_check_s=orphan_check_s))
        stop = threading.Event()
        thread = threading.Thread(target=service.run, args=(stop,), daemon=True)
        beats0, b0 = fleet.beats.value, time.monotonic()
        samples: list[tuple[float, int]] = []
        t_start = time.perf_counter()
        thread.start()
        last_change, last = time.perf_counter(), -1
        try:
            while True:
                now, got = time.perf_counter(), service.admitted_total
                samples.append((now, got))
                if got != last:
                    last_change, last = now, got
                if got >= n or now - last_change > 20:  # done, or stuck for 20 s
                    break
                time.sleep(0.01)
            total_s = time.perf_counter() - t_start
            # Steady: arrivals at a fixed rate into a broker with n sessions resident.
            t_stop, sent = ctx.Event(), ctx.Value("q", 0)
            feeder = ctx.Process(target=trickle, args=(url, ns, steady_rate, t_stop, sent),
                                 daemon=True)
            feeder.start()
            while sent.value == 0 and feeder.is_alive():
                time.sleep(0.01)
            time.sleep(min(1.0, steady_s / 4))  # let the first arrivals through
            s_lo, a_lo = time.perf_counter(), service.admitted_total
            time.sleep(steady_s)
            s_hi, a_hi = time.perf_counter(), service.admitted_total
            t_stop.set()
            feeder.join(timeout=30)
        finally:
            stop.set()
            thread.join(timeout=30)
        beat_rate = (fleet.beats.value - beats0) / (time.monotonic() - b0)
    r = redis.Redis.from_url(url)
    wipe(r, ns)
    r.close()
    admitted = samples[-1][1]
    lo, hi = 0.1 * n, 0.9 * min(admitted, n)
    t_lo = next(t for t, a in samples if a >= lo) if admitted >= lo else samples[0][0]
    t_hi = next(t for t, a in samples if a >= hi)
    a1 = next(a for t, a in samples if t >= t_lo)
    a2 = next(a for t, a in samples if t >= t_hi)
    calls = drain_calls(timed.calls, lo, hi)
    drain = decide_stats(calls, max(t_hi, calls[-1][0] + calls[-1][1]) - min(t_lo, calls[0][0])
                         if calls else 0.0)
    steady = decide_stats([c for c in timed.calls if s_lo <= c[0] <= s_hi], s_hi - s_lo)
    return {
        "backends": backends,
        "sessions": n,
        "admitted": admitted,
        # (a drain taken in one or two calls has no window between samples: the whole run's)
        "admission_per_s": (a2 - a1) / (t_hi - t_lo) if t_hi > t_lo else admitted / total_s,
        "admission_overall_per_s": admitted / total_s,
        **{f"drain_{k}": v for k, v in drain.items()},
        "drain_decide_us_per_admission": 1000 * drain["decide_median_ms"]
        / max(drain["admissions_per_decide"], 1e-9),
        "steady_arrivals_per_s": steady_rate,
        "steady_admitted_per_s": (a_hi - a_lo) / (s_hi - s_lo),
        **{f"steady_{k}": v for k, v in steady.items()},
        "heartbeats_per_s": beat_rate,
    }


# -- 2. Redis memory per pending session -------------------------------------------------------
def used_memory(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


def bench_memory(url: str, prompt_tokens: int, n: int) -> dict[str, float]:
    """Enqueue n sessions of one workload with `prompt_tokens`-token prompts into a fresh
    namespace; bytes per session from used_memory and, apart, from MEMORY USAGE."""
    ns = f"scale{uuid.uuid4().hex[:8]}"
    workload = "agentic" if prompt_tokens > 1_000 else "rlvr"
    pool = prompts(64, prompt_tokens, seed=2)
    r = redis.Redis.from_url(url)
    client = RolloutClient(url, ns)
    enqueue_all(client, "w", GROUP, pool, workload)  # scripts loaded, keys of the namespace made
    before = used_memory(r)
    enqueue_all(client, "m", n, pool, workload, batch=1_000)
    after = used_memory(r)
    k = Keys(ns)
    stream = int(r.memory_usage(k.pending(workload), samples=0))
    picks = random.Random(3).sample(range(n), min(200, n))
    hashes = [int(r.memory_usage(k.session(f"m{i}"), samples=0)) for i in picks]
    bodies = [int(r.memory_usage(k.body(f"m{i}"), samples=0) or 0) for i in picks]
    one = sessions("m", 0, 1, pool, workload)[0]
    body = len(one.model_dump_json())
    client.close()
    wipe(r, ns)
    r.close()
    per = (after - before) / n
    return {
        "prompt_tokens": prompt_tokens,
        "sessions": n,
        "bytes_per_pending": per,
        "stream_bytes_per_entry": stream / (n + GROUP),
        "hash_bytes_per_session": statistics.mean(hashes),
        "body_key_bytes_per_session": statistics.mean(bodies),
        "stored_body_bytes": len(dump_body(one)),
        "session_json_bytes": body,
        "session_json_compact_bytes": len(sessions("m", 0, 1, pool, workload)[0]
                                          .model_dump_json(exclude_defaults=True)),
    }


def wipe(r: redis.Redis, ns: str) -> None:
    delete_namespace(r, Keys(ns).prefix, batch=5_000)


# -- 2b/3. one million pending: broker RSS and /v1/status -------------------------------------
def rss_bytes(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(rest.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollout_broker.cli", *args]


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def decide_count(metrics_url: str) -> int:
    try:
        text = httpx.get(metrics_url, timeout=2).text
    except httpx.HTTPError:
        return 0
    m = re.search(r"^rb_broker_decide_seconds_count (\S+)$", text, re.MULTILINE)
    return int(float(m.group(1))) if m else 0


def start_broker(url: str, ns: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(cli("broker", "--redis-url", url, "--namespace", ns,
                                "--metrics-port", str(port), "--log-level", "WARNING"),
                            cwd=ROOT)
    return proc, f"http://127.0.0.1:{port}/metrics"


def broker_rss(url: str, ns: str, min_decides: int, timeout: float = 300.0
               ) -> tuple[subprocess.Popen, dict[str, float]]:
    """Start a broker on `ns`; once it has called decide() `min_decides` times, its RSS.
    min_decides 0: after 3 s (an empty namespace never calls decide). The broker keeps
    running; the caller stops it."""
    proc, metrics_url = start_broker(url, ns)
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the broker exited with code {proc.returncode}")
        n = decide_count(metrics_url)
        if (min_decides and n >= min_decides) or (not min_decides and time.monotonic() - t0 > 3):
            break
        if time.monotonic() - t0 > timeout:
            stop_process(proc)
            raise RuntimeError(f"the broker called decide() {n} times in {timeout:.0f} s")
        time.sleep(0.2)
    ready_s = time.monotonic() - t0
    rss = [rss_bytes(proc.pid)[0]]
    for _ in range(10):  # a few more loops
        time.sleep(0.2)
        rss.append(rss_bytes(proc.pid)[0])
    return proc, {"rss_bytes": max(rss), "hwm_bytes": rss_bytes(proc.pid)[1],
                  "decide_calls": decide_count(metrics_url), "ready_s": ready_s}


def start_api(url: str, ns: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(cli("api", "--port", str(port), "--redis-url", url, "--namespace", ns,
                                "--log-level", "warning"),
                            cwd=ROOT, env={**os.environ, "RB_API_TOKEN": ""})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            raise RuntimeError("the API did not start")
        time.sleep(0.1)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def time_status(base: str, n: int) -> tuple[list[float], int]:
    out = []
    with httpx.Client(base_url=base, timeout=10) as http:
        for _ in range(50):
            http.get("/v1/status").raise_for_status()
        depth = sum(w["depth"] for w in http.get("/v1/status").json()["workloads"])
        for _ in range(n):
            t0 = time.perf_counter()
            r = http.get("/v1/status")
            out.append((time.perf_counter() - t0) * 1000)
            r.raise_for_status()
    return out, depth


def bench_million(url: str, n: int, backends: int, requests: int) -> dict[str, float]:
    r = redis.Redis.from_url(url)
    empty_ns = f"scale{uuid.uuid4().hex[:8]}"
    proc, base_rss = broker_rss(url, empty_ns, min_decides=0)
    stop_process(proc)
    wipe(r, empty_ns)

    ns = f"scale{uuid.uuid4().hex[:8]}"
    pool = prompts(1_024, 150, seed=4)
    client = RolloutClient(url, ns)
    client.set_mixture(dict(MIX))
    before = used_memory(r)
    t0 = time.perf_counter()
    in_enqueue = enqueue_all(client, "p", n, pool)
    enqueue_wall = time.perf_counter() - t0
    after = used_memory(r)
    client.close()
    out: dict[str, float] = {
        "pending": n, "prompt_tokens": 150, "enqueue_wall_s": enqueue_wall,
        "enqueue_calls_s": in_enqueue, "enqueue_per_s": n / in_enqueue,
        "redis_used_memory_bytes": after, "redis_bytes_per_pending": (after - before) / n,
        "broker_rss_empty_bytes": base_rss["rss_bytes"],
    }
    broker = api = None
    # 700k KV tokens each: the broker admits a few hundred sessions, then decides on every beat.
    with Fleet(url, ns, backends, capacity=700_000, kv_usage=0.3):
        try:
            broker, rss = broker_rss(url, ns, min_decides=20)
            out.update(broker_rss_bytes=rss["rss_bytes"], broker_hwm_bytes=rss["hwm_bytes"],
                       broker_decide_calls=rss["decide_calls"], broker_ready_s=rss["ready_s"])
            api, base = start_api(url, ns)
            cpu0, w0 = cpu_seconds(broker.pid), time.monotonic()
            ms, depth = time_status(base, requests)
            out["broker_cpu_share_during_status"] = ((cpu_seconds(broker.pid) - cpu0)
                                                     / (time.monotonic() - w0))
            out["broker_rss_after_status_bytes"] = rss_bytes(broker.pid)[0]
            ms.sort()
            out.update(status_depth=depth, status_requests=len(ms),
                       status_p50_ms=statistics.median(ms),
                       status_p99_ms=ms[int(0.99 * (len(ms) - 1))], status_max_ms=ms[-1])
            stop_process(broker)  # the same GETs with only the API, Redis and the beats
            ms, _ = time_status(base, requests)
            ms.sort()
            out.update(status_no_broker_p50_ms=statistics.median(ms),
                       status_no_broker_p99_ms=ms[int(0.99 * (len(ms) - 1))])
        finally:
            for p in (api, broker):
                if p is not None:
                    stop_process(p)
    wipe(r, ns)
    r.close()
    return out


# -- 4. simulator wall time against engine count -----------------------------------------------
def scaled_scenario(engines: int, iterations: int, path: Path) -> None:
    """scenarios/demo.yaml at `engines` engines, per-engine load as the demo's (4 engines, batch
    32, in-flight 256), `iterations` iterations, no wall-clock cut."""
    data = yaml.safe_load((ROOT / "scenarios" / "demo.yaml").read_text())
    base = data["fleet"]["engines"]
    data["name"] = f"demo-x{engines}"
    data["fleet"]["engines"] = engines
    for key in ("batch_size", "inflight_bound"):
        data["trainer"][key] = data["trainer"][key] * engines // base
    data["trainer"]["iterations"] = iterations
    data["limits"] = {"max_wall_s": 7_200}
    path.write_text(yaml.safe_dump(data))


def bench_sim(engines: tuple[int, ...], iterations: int) -> dict[str, Any]:
    """One misa_t run per engine count: the machinery of `sim.bench.run_one` (what
    `rollout-broker bench` runs per policy), with the policy's decide() timed."""
    from broker.policies import make_policy
    from sim.fleet import FleetSim
    from sim.scenario import load_scenario
    from sim.workloads.source import make_source

    walls, finished, decide_s, calls = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="rb-scale-") as tmp:
        for n in engines:
            path = Path(tmp) / f"demo-x{n}.yaml"
            scaled_scenario(n, iterations, path)
            t0 = time.perf_counter()
            scenario = load_scenario(path)
            sim = FleetSim(scenario, None, make_source(scenario, path))
            timed = TimedPolicy(make_policy("misa_t"))
            sim.policy = timed  # type: ignore[assignment]
            res = sim.run()
            walls.append(time.perf_counter() - t0)
            if not res.completed:
                raise RuntimeError(f"simulator: the {n}-engine run was cut short")
            finished.append(len(res.sessions))
            decide_s.append(sum(c[1] for c in timed.calls))
            calls.append(len(timed.calls))
            print(f"  simulator: {n} engines, {walls[-1]:.1f} s wall ({decide_s[-1]:.1f} s in "
                  f"{calls[-1]} decide() calls), {len(res.sessions)} sessions, "
                  f"{res.sim_time_s:.0f} s simulated", file=sys.stderr)
    slope, intercept, r2 = least_squares(engines, walls)
    exponent = least_squares([math.log(e) for e in engines], [math.log(w) for w in walls])[0]
    return {"engines": list(engines), "wall_s": walls, "sessions": finished,
            "decide_s": decide_s, "decide_calls": calls,
            "iterations": iterations, "slope_s_per_engine": slope, "intercept_s": intercept,
            "r2": r2, "loglog_exponent": exponent,
            "wall_ratio_last_first": walls[-1] / walls[0],
            "engine_ratio_last_first": engines[-1] / engines[0]}


def least_squares(xs, ys) -> tuple[float, float, float]:
    """(slope, intercept, R^2) of y = a·x + b."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = sxy / sxx
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys))
    return slope, intercept, (1 - ss_res / ss_tot) if ss_tot else 1.0


# -- report ------------------------------------------------------------------------------------
def met(figure: str, value: float) -> str:
    if figure not in TARGETS:
        return ""
    op, bound = TARGETS[figure]
    ok = value >= bound if op == ">=" else value <= bound
    return "met" if ok else "NOT met"


def table(report: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows = []
    for policy, a in report.get("admission", {}).items():
        rows.append((f"admission, {policy}, {a['backends']} backends (drain {a['sessions']:,})",
                     f"{a['admission_per_s']:,.0f} sessions/s", ">= 5,000",
                     met("admission_per_s", a["admission_per_s"])))
        drain = (f"{a['drain_decide_median_ms']:.1f} ms (p99 {a['drain_decide_p99_ms']:.1f}; "
                 f"{a['drain_admissions_per_decide']:,.0f} admitted/call, "
                 f"{a['drain_decide_us_per_admission']:.0f} us each)")
        rows.append(("  decide() median, drain", drain, "<= 5 ms",
                     met("decide_median_ms", a["drain_decide_median_ms"])))
        steady = (f"{a['steady_decide_median_ms']:.1f} ms (p99 {a['steady_decide_p99_ms']:.1f}; "
                  f"{a['steady_arrivals_per_s']:,.0f}/s arriving, "
                  f"{a['steady_admissions_per_decide']:,.0f} admitted/call, "
                  f"{a['sessions']:,} resident)")
        rows.append(("  decide() median, steady", steady, "<= 5 ms",
                     met("decide_median_ms", a["steady_decide_median_ms"])))
    for m in report.get("memory", {}).values():
        split = (f"{m['bytes_per_pending']:,.0f} B (stream {m['stream_bytes_per_entry']:,.0f} + "
                 f"hash {m['hash_bytes_per_session']:,.0f} + "
                 f"body key {m.get('body_key_bytes_per_session', 0):,.0f}; stored body "
                 f"{m.get('stored_body_bytes', 0):,} B, full JSON {m['session_json_bytes']:,})")
        rows.append((f"Redis per pending, {m['prompt_tokens']}-token prompt", split, "<= 1 KB",
                     met("redis_bytes_per_pending", m["bytes_per_pending"])))
    mm = report.get("million")
    if mm:
        n = f"{mm['pending']:,.0f}"
        used = (f"{mm['redis_bytes_per_pending']:,.0f} B "
                f"({mm['redis_used_memory_bytes'] / 2**30:.2f} GiB used)")
        rows.append((f"Redis per pending at {n}", used, "<= 1 KB",
                     met("redis_bytes_per_pending", mm["redis_bytes_per_pending"])))
        enq = (f"{mm['enqueue_wall_s']:.0f} s, of which {mm['enqueue_calls_s']:.0f} s in "
               f"enqueue() ({mm['enqueue_per_s']:,.0f} sessions/s)")
        rows.append((f"enqueue {n} (batches of 5,000)", enq, "", ""))
        rss = (f"{mm['broker_rss_bytes'] / 2**20:,.0f} MiB (empty namespace "
               f"{mm['broker_rss_empty_bytes'] / 2**20:,.0f} MiB)")
        rows.append((f"broker RSS, {n} pending", rss, "", ""))
        running = (f"p50 {mm['status_p50_ms']:.2f} ms, p99 {mm['status_p99_ms']:.2f} ms (broker "
                   f"used {mm['broker_cpu_share_during_status']:.0%} of a core)")
        rows.append((f"/v1/status, {n} pending, broker running", running, "p99 <= 20 ms",
                     met("status_p99_ms", mm["status_p99_ms"])))
        stopped = (f"p50 {mm['status_no_broker_p50_ms']:.2f} ms, "
                   f"p99 {mm['status_no_broker_p99_ms']:.2f} ms")
        rows.append((f"/v1/status, {n} pending, broker stopped", stopped, "p99 <= 20 ms",
                     met("status_p99_ms", mm["status_no_broker_p99_ms"])))
    s = report.get("simulator")
    if s:
        for e, w, d, n in zip(s["engines"], s["wall_s"], s["decide_s"], s["sessions"]):
            wall = f"{w:.1f} s ({d:.1f} s in decide(); {n:,} sessions, {1000 * w / n:.1f} ms each)"
            rows.append((f"simulator wall, {e} engines ({s['iterations']} iterations)", wall,
                         "", ""))
        fit = (f"{s['slope_s_per_engine']:.3f} s/engine, R^2 {s['r2']:.3f}; "
               f"x{s['wall_ratio_last_first']:.0f} wall for x{s['engine_ratio_last_first']:.0f} "
               f"engines, exponent {s['loglog_exponent']:.2f}")
        rows.append(("simulator scaling", fit, "linear (1.00)",
                     "linear" if abs(s["loglog_exponent"] - 1) <= 0.1 else "NOT linear"))
    return rows


def print_table(rows: list[tuple[str, str, str, str]]) -> None:
    head = ("figure", "measured", "target", "")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    for r in [head, tuple("-" * w for w in widths), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def figures(report: dict[str, Any]) -> dict[str, float]:
    """Every figure as one flat name -> number map (the JSON's `figures`)."""
    out: dict[str, float] = {}
    for section in ("admission", "memory"):
        for name, d in report.get(section, {}).items():
            for k, v in d.items():
                out[f"{section}.{name}.{k}"] = float(v)
    for k, v in report.get("million", {}).items():
        out[f"million.{k}"] = float(v)
    s = report.get("simulator")
    if s:
        for e, w, d, c in zip(s["engines"], s["wall_s"], s["decide_s"], s["decide_calls"]):
            out[f"simulator.wall_s.{e}"] = w
            out[f"simulator.decide_s.{e}"] = d
            out[f"simulator.decide_calls.{e}"] = c
        for k in ("slope_s_per_engine", "intercept_s", "r2", "loglog_exponent",
                  "wall_ratio_last_first"):
            out[f"simulator.{k}"] = s[k]
    return out


def git_state() -> str:
    """The commit measured, with '+dirty' when the working tree differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, timeout=10, check=False).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               text=True, capture_output=True, timeout=10,
                               check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small smoke version (under a minute)")
    ap.add_argument("--json", metavar="PATH", help="write every figure here")
    ap.add_argument("--redis-url", default=None,
                    help="use this Redis (default: a private redis-server, removed at the end)")
    ap.add_argument("--skip", default="", help="comma-separated: admission,memory,million,sim")
    ap.add_argument("--policies", default=None,
                    help="admission: comma-separated policies (default misa_t,least_loaded)")
    args = ap.parse_args()
    cfg = QUICK if args.quick else Config()
    if args.policies:
        names = tuple(p for p in args.policies.split(",") if p)
        unknown_policies = set(names) - set(policy_names())
        if not names or unknown_policies:
            ap.error(f"--policies: unknown {', '.join(sorted(unknown_policies)) or '(none given)'}")
        cfg = replace(cfg, policies=names)
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - {"admission", "memory", "million", "sim"}
    if unknown:
        ap.error(f"--skip: unknown {', '.join(sorted(unknown))}")
    handle = RedisHandle(url=args.redis_url) if args.redis_url else start_private_redis()
    report: dict[str, Any] = {"quick": args.quick, "config": {
        "backends": cfg.backends, "admit_n": cfg.admit_n, "steady_s": cfg.steady_s,
        "steady_rate": cfg.steady_rate, "million": cfg.million,
        "million_backends": cfg.million_backends, "status_requests": cfg.status_requests,
        "sim_engines": list(cfg.sim_engines), "sim_iterations": cfg.sim_iterations}}
    t_all = time.perf_counter()
    try:
        if "admission" not in skip:
            report["admission"] = {}
            for policy in cfg.policies:
                print(f"admission: {policy}, {cfg.backends} backends, {cfg.admit_n:,} sessions",
                      file=sys.stderr)
                with few_collections():  # as the `rollout-broker broker` process runs
                    report["admission"][policy] = bench_admission(
                        handle.url, policy, cfg.backends, cfg.admit_n,
                        BrokerSettings().orphan_check_s, cfg.steady_s, cfg.steady_rate)
        if "memory" not in skip:
            report["memory"] = {}
            for tokens, n in cfg.memory_n:
                print(f"memory: {n:,} sessions of {tokens} prompt tokens", file=sys.stderr)
                report["memory"][str(tokens)] = bench_memory(handle.url, tokens, n)
        if "million" not in skip:
            print(f"million: {cfg.million:,} pending, broker RSS, /v1/status", file=sys.stderr)
            report["million"] = bench_million(handle.url, cfg.million, cfg.million_backends,
                                              cfg.status_requests)
        if "sim" not in skip:
            print(f"simulator: engines {cfg.sim_engines}", file=sys.stderr)
            report["simulator"] = bench_sim(cfg.sim_engines, cfg.sim_iterations)
    finally:
        handle.close()
    report["figures"] = figures(report)
    report["machine"] = {"cores": os.cpu_count(), "load_average_1m": os.getloadavg()[0],
                         "wall_s": time.perf_counter() - t_all, "commit": git_state()}
    print_table(table(report))
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}, "
          f"{report['machine']['wall_s']:.0f} s in all, commit {report['machine']['commit']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_until_interrupted(main, "scale"))
