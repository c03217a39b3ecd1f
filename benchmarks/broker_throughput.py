"""Broker throughput against a real Redis, with 16 simulated backends.

Measures, each in a fresh namespace:
1. enqueue: sessions/s from one RolloutClient in batches (no broker running);
2. admission: sessions/s the broker admits from a full queue (16 backends with free capacity,
   heartbeating and finishing in a child process);
3. latency: p50/p99 enqueue→admitted (from each session's state hash) for sessions enqueued
   one at a time into an idle broker with free capacity.

    python benchmarks/broker_throughput.py [--redis-url URL] [--policy NAME|module:factory]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import threading
import time
import uuid

import redis

from sim.backend import SimulatedBackend
from broker.heartbeat import EngineMetrics
from broker.client import RolloutClient
from broker.keys import Keys
from broker.redis_server import ensure_redis
from broker.policies import DEFAULT_POLICY
from broker.service import BrokerService, BrokerSettings, load_policy
from broker.session import Session
from broker.worker_link import WorkerLink

BACKENDS = 16


def sessions(n: int, tag: str) -> list[Session]:
    work = ("rlvr", "rlhf", "agentic")
    return [Session(session_id=f"{tag}{i}", workload=work[i % 3],
                    prompt_token_ids=list(range(1, 65)), max_tokens=256) for i in range(n)]


def run_backends(url: str, ns: str, stop: mp.Event, work: bool) -> None:
    """16 backends with free capacity. `work`: read, run and finish admitted sessions (as
    workers would); else only register and heartbeat (isolates the broker's own rate)."""
    if work:
        fleet = [SimulatedBackend(url, ns, f"gpu-{i}", capacity_tokens=10**9, heartbeat_s=0.5,
                                  heartbeat_ttl_s=5.0).start() for i in range(BACKENDS)]
        stop.wait()
        for b in fleet:
            b.stop()
        return
    links = [WorkerLink(url, ns, f"gpu-{i}", heartbeat_ttl_s=5.0) for i in range(BACKENDS)]
    for link in links:
        link.register(10**9, 32768)
    while True:
        for link in links:
            link.heartbeat(EngineMetrics(kv_usage=0.0, running=0, waiting=0, preemptions_total=0,
                                         prefix_queries_total=0, prefix_hits_total=0))
        if stop.wait(0.5):
            return


def wipe(client: redis.Redis, ns: str) -> None:
    for key in client.scan_iter(match=f"rb:{{{ns}}}:*", count=1000):
        client.delete(key)


def bench_enqueue(url: str, n: int, batch: int) -> float:
    ns = f"bench{uuid.uuid4().hex[:8]}"
    c = RolloutClient(url, ns)
    items = sessions(n, "e")
    t0 = time.perf_counter()
    for i in range(0, n, batch):
        c.enqueue(items[i:i + batch])
    dt = time.perf_counter() - t0
    c.close()
    wipe(redis.Redis.from_url(url), ns)
    return n / dt


class Fleet:
    def __init__(self, url: str, ns: str, work: bool) -> None:
        self.stop = mp.Event()
        self.proc = mp.Process(target=run_backends, args=(url, ns, self.stop, work), daemon=True)

    def __enter__(self) -> Fleet:
        self.proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.proc.join(timeout=30)


def wait_backends(url: str, ns: str) -> None:
    r = redis.Redis.from_url(url)
    k = Keys(ns)
    while sum(r.exists(k.heartbeat(f"gpu-{i}")) for i in range(BACKENDS)) < BACKENDS:
        time.sleep(0.05)


def bench_admission(url: str, n: int, policy: str, work: bool) -> float:
    ns = f"bench{uuid.uuid4().hex[:8]}"
    with Fleet(url, ns, work):
        wait_backends(url, ns)
        c = RolloutClient(url, ns)
        items = sessions(n, "a")
        for i in range(0, n, 2000):
            c.enqueue(items[i:i + 2000])
        service = BrokerService(url, ns, load_policy(policy), BrokerSettings(lease_period_s=5))
        stop = threading.Event()
        t = threading.Thread(target=service.run, args=(stop,), daemon=True)
        t0 = time.perf_counter()
        t.start()
        while service.admitted_total < n:
            time.sleep(0.005)
        dt = time.perf_counter() - t0
        stop.set()
        t.join()
        c.close()
    wipe(redis.Redis.from_url(url), ns)
    return n / dt


def bench_latency(url: str, n: int, policy: str) -> tuple[float, float]:
    ns = f"bench{uuid.uuid4().hex[:8]}"
    k = Keys(ns)
    r = redis.Redis.from_url(url)
    with Fleet(url, ns, work=True):
        wait_backends(url, ns)
        c = RolloutClient(url, ns)
        service = BrokerService(url, ns, load_policy(policy), BrokerSettings(lease_period_s=5))
        stop = threading.Event()
        t = threading.Thread(target=service.run, args=(stop,), daemon=True)
        t.start()
        while not r.exists(k.lease):
            time.sleep(0.01)
        for s in sessions(n, "l"):
            c.enqueue([s])
            time.sleep(0.004)  # an open-loop trickle: the broker is idle between arrivals
        while service.admitted_total < n:
            time.sleep(0.01)
        stop.set()
        t.join()
        c.close()
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        pipe.hmget(k.session(f"l{i}"), "enqueued_at", "admitted_at")
    lat = sorted((float(a) - float(e)) * 1000 for e, a in pipe.execute())
    wipe(r, ns)
    return statistics.median(lat), lat[int(0.99 * (n - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--policy", default=DEFAULT_POLICY, help="default: the broker's own default")
    ap.add_argument("--enqueue-n", type=int, default=40_000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--admit-n", type=int, default=20_000)
    ap.add_argument("--latency-n", type=int, default=500)
    args = ap.parse_args()
    handle = ensure_redis(args.redis_url)
    try:
        load_policy(args.policy)
        enq = bench_enqueue(handle.url, args.enqueue_n, args.batch)
        print(f"enqueue:   {enq:10,.0f} sessions/s  (one client, batches of {args.batch})")
        for work in (False, True):
            adm = bench_admission(handle.url, args.admit_n, args.policy, work)
            what = "running+finishing sessions" if work else "heartbeat only"
            print(f"admission: {adm:10,.0f} sessions/s  ({args.admit_n} queued, {BACKENDS} "
                  f"backends {what}, policy {args.policy})")
        p50, p99 = bench_latency(handle.url, args.latency_n, args.policy)
        print(f"enqueue→admitted: p50 {p50:.2f} ms, p99 {p99:.2f} ms  (idle broker, free capacity)")
    finally:
        handle.close()


if __name__ == "__main__":
    main()
