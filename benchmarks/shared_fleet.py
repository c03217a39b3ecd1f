"""Two jobs sharing four workers: each job's KV alone and under contention, either job first.

The fleet, jobs and sampling of tests/workers/test_shared_fleet.py (A guaranteed 30%, B 70%;
simulated engines, MISA-T brokers, real Redis): `--first` runs alone for 8 s, then the other
job is enqueued, and 5-15 s after its broker first says it waits both are measured. Prints the
first job's KV alone (of the fleet's capacity, and the part it may plan against), each job's
share of the KV in use under contention with its mean part (of the fleet), and what each still
had queued at the end (a job whose queue ran dry was not contending for the whole window).

    python3 -m benchmarks.shared_fleet --first b     # from the repository root (it uses tests/)
"""

from __future__ import annotations

import argparse
import time
import uuid

import redis

from broker.client import RolloutClient
from broker.policies import make_policy
from sim.server.testing import running_engine
from tests.broker.helpers import BrokerThread, wait_until
from tests.workers.helpers import WorkerThread
from tests.workers.test_shared_fleet import ENGINES, KV, SHARES, KvSampler, jobs_sessions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--first", choices=sorted(SHARES), default="b")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = ap.parse_args()
    first, second = args.first, next(j for j in SHARES if j != args.first)
    tag = uuid.uuid4().hex[:8]
    ns = {job: f"bench-share-{job}-{tag}" for job in SHARES}
    tenants = {ns[j]: s for j, s in SHARES.items()}
    rc = redis.Redis.from_url(args.redis_url)
    models = ("m-a", "m-a", "m-b", "m-b")
    with running_engine(time_scale=10.0, kv_tokens=KV, model_name=models[0], max_loras=2) as e1, \
            running_engine(time_scale=10.0, kv_tokens=KV, model_name=models[1], max_loras=2) as e2, \
            running_engine(time_scale=10.0, kv_tokens=KV, model_name=models[2], max_loras=2) as e3, \
            running_engine(time_scale=10.0, kv_tokens=KV, model_name=models[3], max_loras=2) as e4:
        engines = dict(zip(ENGINES, (e1, e2, e3, e4)))
        workers = [WorkerThread(args.redis_url, ns["a"], b, e.url, time_scale=10.0,
                                tenants=tenants).start() for b, e in engines.items()]
        brokers = [BrokerThread(args.redis_url, n, make_policy("misa_t"), lease_s=10.0).start()
                   for n in ns.values()]
        clients = {j: RolloutClient(args.redis_url, n) for j, n in ns.items()}
        sampler = KvSampler(rc, ns).start()
        try:
            for c in clients.values():
                assert wait_until(lambda c=c: all(
                    c.status()["backends"].get(b, {}).get("healthy") for b in ENGINES), 30)
            clients["a"].register_adapter("a1", "/adapters/a1")
            clients["a"].register_adapter("a2", "/adapters/a2")
            clients["b"].register_adapter("b1", "/adapters/b1")
            clients[first].enqueue(jobs_sessions(first, 600))
            t0 = time.monotonic()
            time.sleep(8.0)
            alone = sampler.mean(t0 + 2.0, time.monotonic())
            clients[second].enqueue(jobs_sessions(second, 600))
            assert wait_until(lambda: any(rc.hget(f"rb:{{{ns[second]}}}:ledger:{b}",
                                                  "waiting_at") for b in ENGINES), 30)
            t1 = time.monotonic()
            time.sleep(15.0)
            both = sampler.mean(t1 + 5.0, time.monotonic())
            queued = {j: sum(c.status()["pending"].values()) for j, c in clients.items()}
        finally:
            sampler.stop()
            for b in brokers:
                b.stop()
            for w in workers:
                w.stop()
            for c in clients.values():
                c.close()
    cap = KV * len(ENGINES)
    used = both["a"] + both["b"]
    print(f"{first} alone (share {SHARES[first]}): {alone[first] / cap:.3f} of the fleet's KV, "
          f"its part {alone[f'{first}_part'] / cap:.3f} of it")
    print("both queued: " + ", ".join(f"{j} {both[j] / used:.3f} of the KV in use (share "
                                      f"{SHARES[j]}, part {both[f'{j}_part'] / cap:.3f})"
                                      for j in SHARES)
          + f"; KV in use {used / cap:.3f} of the fleet's")
    print(f"queued at the end: {queued}")


if __name__ == "__main__":
    main()
