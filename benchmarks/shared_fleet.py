"""Two jobs sharing four workers: each job's KV alone and under contention, either job first.

The fleet, jobs and sampling of tests/workers/test_shared_fleet.py (A guaranteed 30%, B 70%;
simulated engines, MISA-T brokers, real Redis; the KV each job holds read from the engines):
`--first` runs alone for `--alone-s`, then the other job is enqueued, and from a third of
`--both-s` after its broker first says it waits to the end both are measured. Prints the first
job's KV alone (of the fleet's capacity, and the part it may plan against; its first 2 s left
out), each job's KV under contention (of the fleet, and of the KV in use) with its mean part,
on how many engines each said it had work waiting, and what each still had queued at the
end (a job whose queue ran dry, or whose sessions for one model did, was not contending for
the whole window everywhere).

Everything runs in one Python process on this machine's cores. At the test's `--time-scale 10`
(engine time 10x wall time) that process cannot keep the engines fed: workers hold sessions
the engines have not received yet, and the engines sit about a third full. The default of 2
leaves the process room: the measurement is then of the shares, not of the harness.

    python3 -m benchmarks.shared_fleet --first b     # from the repository root (it uses tests/)
"""

from __future__ import annotations

import argparse

from tests.workers.test_shared_fleet import ENGINES, KV, SHARES, jobs_sessions, two_job_fleet


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--first", choices=sorted(SHARES), default="b")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--time-scale", type=float, default=2.0,
                    help="engine seconds per wall second (default 2)")
    ap.add_argument("--alone-s", type=float, default=30.0)
    ap.add_argument("--both-s", type=float, default=60.0)
    args = ap.parse_args()
    first = args.first
    # (sessions enough for a job to stay queued through both windows: a job alone on the fleet
    # finishes about 3 a second at time scale 1)
    n = int(5 * (args.alone_s + args.both_s) * args.time_scale)
    with two_job_fleet(args.redis_url, prefix="bench-share", time_scale=args.time_scale) as fleet:
        alone, both, queued = fleet.alone_then_both(
            {job: jobs_sessions(job, n) for job in SHARES}, first, alone_s=args.alone_s,
            both_s=args.both_s, skip_s=args.both_s / 3)
    cap = KV * len(ENGINES)
    used = both["a"] + both["b"]
    print(f"time scale {args.time_scale:g}")
    print(f"{first} alone (share {SHARES[first]}): {alone[first] / cap:.3f} of the fleet's KV, "
          f"its part {alone[f'{first}_part'] / cap:.3f} of it")
    print("both queued: " + ", ".join(f"{j} {both[j] / cap:.3f} of the fleet's KV, "
                                      f"{both[j] / used:.3f} of the KV in use (share "
                                      f"{SHARES[j]}, part {both[f'{j}_part'] / cap:.3f})"
                                      for j in SHARES)
          + f"; KV in use {used / cap:.3f} of the fleet's")
    print("engines each job said it had work waiting for, of "
          f"{len(ENGINES)}, mean under contention: "
          + ", ".join(f"{j} {both[f'{j}_waiting']:.2f}" for j in SHARES))
    print(f"queued at the end: {queued}")


if __name__ == "__main__":
    main()
