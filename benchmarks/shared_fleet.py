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

from tests.workers.test_shared_fleet import ENGINES, KV, SHARES, jobs_sessions, two_job_fleet


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--first", choices=sorted(SHARES), default="b")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = ap.parse_args()
    first, second = args.first, next(j for j in SHARES if j != args.first)
    with two_job_fleet(args.redis_url, prefix="bench-share") as fleet:
        fleet.clients[first].enqueue(jobs_sessions(first, 600))
        t0 = time.monotonic()
        time.sleep(8.0)
        alone = fleet.sampler.mean(t0 + 2.0, time.monotonic())
        fleet.clients[second].enqueue(jobs_sessions(second, 600))
        fleet.wait_for_waiting(second)
        t1 = time.monotonic()
        time.sleep(15.0)
        both = fleet.sampler.mean(t1 + 5.0, time.monotonic())
        queued = fleet.queued()
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
