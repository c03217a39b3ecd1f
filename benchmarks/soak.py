"""Soak: the fleet of `benchmarks/chaos.py` under load for an hour, with weight updates and
process kills on a schedule, sampling what would grow if anything leaked.

The fleet: a private Redis (append-only, `appendfsync always`), three simulated engines, a worker
attached to each, an active and a standby broker (`misa_t`). A trainer in this process keeps
`--inflight` sessions of the chaos mix (GRPO groups, RLHF pairs, 3-turn agentic episodes) in
flight and reads every result. Every `--update-every` s it runs a weight update (`pause` in the
next of abort / keep / wait, then `resume(v + 1)`); every `--kill-every` s it kill -9s the next
of worker 0, 1, 2, the active broker and engine 0, 1, 2 and restarts it (as a supervisor would).

Sampled every `--sample-every` s: Redis `used_memory`; each process's RSS (engines, workers,
brokers; /proc); the results delivered; the oldest session enqueued and not yet answered (its
age); the p99 of enqueue-to-delivery latency over the last sample interval.

The namespace keeps an ended session's state for `--session-retention-s` (300 s, inside the
warm-up; the default of 3600 s would make Redis grow for the whole first hour).

At the end: every session enqueued was delivered exactly once, no result is left in the stream
(acknowledged ones leave it: one left was published and never delivered), and for each series
its growth: the median of the last five minutes against the median of minutes 10-15 (the first
ten are the warm-up). Target: growth ≤ 5 %, no session stuck.

    python3 benchmarks/soak.py [--duration 3600] [--json out.json] [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.chaos import NAMESPACE, Fleet, Trainer, delivery, session_mix  # noqa: E402
from broker.client import RolloutClient  # noqa: E402
from rollout_broker.demo import run_until_interrupted  # noqa: E402

MODES = ("abort", "keep", "wait")
VICTIMS = ("worker-0", "worker-1", "worker-2", "broker", "engine-0", "engine-1", "engine-2")


@dataclass
class Sample:
    t: float  # seconds since the load started
    redis_used_bytes: int
    rss_bytes: dict[str, int]  # process name -> RSS
    delivered: int
    oldest_outstanding_s: float
    p99_latency_s: float | None


@dataclass
class Report:
    duration_s: float
    session_retention_s: float
    enqueued: int = 0
    done_once: int = 0
    failed: int = 0
    lost: int = 0
    duplicated: int = 0
    weight_updates: int = 0
    kills: list[str] = field(default_factory=list)
    growth: dict[str, float] = field(default_factory=dict)  # series -> relative growth
    max_oldest_outstanding_s: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class TimedTrainer(Trainer):
    """The chaos trainer, remembering when each session went in."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.enqueued_at: dict[str, float] = {}

    def run(self) -> None:
        original = self.client.enqueue

        def enqueue(batch):
            now = time.time()
            for s in batch:
                self.enqueued_at[s.session_id] = now
            return original(batch)
        self.client.enqueue = enqueue  # type: ignore[method-assign]
        super().run()


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def sample(fleet: Fleet, trainer: TimedTrainer, t0: float, since: int) -> Sample:
    r = redis.Redis.from_url(fleet.url, socket_timeout=5)
    try:
        used = int(r.info("memory")["used_memory"])
    except redis.RedisError:
        used = -1
    finally:
        r.close()
    procs = {p.name: rss_bytes(p.process.pid) for p in fleet.all_procs() if p.process is not None}
    now = time.time()
    enqueued_at = trainer.enqueued_at.copy()  # (the trainer thread adds to both meanwhile)
    delivered = trainer.delivered[:]
    answered = {r.session_id for r, _ in delivered}
    outstanding = [t for sid, t in enqueued_at.items() if sid not in answered]
    recent = [t - enqueued_at[r.session_id] for r, t in delivered[since:]
              if r.session_id in enqueued_at]
    p99 = statistics.quantiles(recent, n=100)[98] if len(recent) >= 100 else None
    return Sample(t=round(now - t0, 1), redis_used_bytes=used, rss_bytes=procs,
                  delivered=len(delivered),
                  oldest_outstanding_s=round(now - min(outstanding), 2) if outstanding else 0.0,
                  p99_latency_s=p99)


def kill_next(fleet: Fleet, i: int) -> str:
    victim = VICTIMS[i % len(VICTIMS)]
    kind, _, n = victim.partition("-")
    if kind == "broker":
        fleet.brokers[0].kill()
        fleet.restart(fleet.brokers, 0, fleet.broker)
    elif kind == "worker":
        fleet.workers[int(n)].kill()
        fleet.restart(fleet.workers, int(n), fleet.worker)
    else:
        fleet.engines[int(n)].kill()
        time.sleep(1.0)
        fleet.restart(fleet.engines, int(n), fleet.engine)
    return victim


def growth(samples: list[Sample], key, first: tuple[float, float], last_s: float) -> float | None:
    end = samples[-1].t
    a = [key(s) for s in samples if first[0] <= s.t < first[1] and key(s) is not None]
    b = [key(s) for s in samples if s.t >= end - last_s and key(s) is not None]
    if not a or not b or statistics.median(a) <= 0:
        return None
    return statistics.median(b) / statistics.median(a) - 1.0


def run(args: argparse.Namespace) -> Report:
    workdir = Path(tempfile.mkdtemp(prefix="rb-soak-"))
    fleet = Fleet(workdir, args.time_scale, args.kv_tokens)
    sessions, _ = session_mix(args.sessions, poison=False)
    report = Report(duration_s=args.duration, session_retention_s=args.session_retention_s)
    fleet.start()
    trainer = TimedTrainer(fleet.url, sessions, args.inflight, args.duration)
    control = RolloutClient(fleet.url, NAMESPACE)
    try:
        control.set_session_retention(args.session_retention_s)
        t0 = time.time()
        trainer.start()
        next_sample, next_update, next_kill = 0.0, args.update_every, args.kill_every
        version, kills, since = 0, 0, 0
        while (elapsed := time.time() - t0) < args.duration and trainer.error is None:
            if elapsed >= next_sample:
                s = sample(fleet, trainer, t0, since)
                since = s.delivered
                report.samples.append(s)
                print(f"soak {s.t:7.0f} s: {s.delivered:,} results, redis {s.redis_used_bytes / 2**20:.1f} MiB, "
                      f"oldest {s.oldest_outstanding_s:.1f} s, p99 {s.p99_latency_s}", file=sys.stderr,
                      flush=True)
                next_sample += args.sample_every
            if elapsed >= next_update:
                mode = MODES[report.weight_updates % len(MODES)]
                try:
                    control.pause(mode, timeout=60)
                except TimeoutError as exc:
                    report.notes.append(f"pause at {elapsed:.0f} s: {exc}")
                version += 1
                control.resume(version)
                report.weight_updates += 1
                next_update += args.update_every
            if elapsed >= next_kill:
                report.kills.append(f"{elapsed:.0f} s: {kill_next(fleet, kills)}")
                kills += 1
                next_kill += args.kill_every
            time.sleep(0.5)
        deadline = time.monotonic() + args.drain_timeout
        while time.monotonic() < deadline and \
                len({r.session_id for r, _ in trainer.delivered}) < trainer.enqueued:
            time.sleep(0.5)
        trainer.stop.set()
        trainer.join(timeout=30)
        if trainer.error is not None:
            report.notes.append(f"trainer: {type(trainer.error).__name__}: {trainer.error}")
        finish(report, fleet, trainer, sessions)
    finally:
        control.close()
        fleet.close()
        trainer.client.close()
    report.notes.append(f"logs in {workdir}")
    return report


def finish(report: Report, fleet: Fleet, trainer: TimedTrainer, sessions) -> None:
    ids = [s.session_id for s in sessions[:trainer.enqueued]]
    d = delivery(trainer.delivered, ids, fleet.url)
    report.enqueued = len(ids)
    report.done_once, report.failed = d.done_once, len(d.failed)
    report.lost, report.duplicated = d.lost, d.duplicated
    report.notes += d.notes
    samples = report.samples
    report.max_oldest_outstanding_s = max((s.oldest_outstanding_s for s in samples), default=0.0)
    first = (600.0, 900.0) if report.duration_s >= 1800 else \
        (report.duration_s / 6, report.duration_s / 4)  # (a short run: its own warm-up)
    last = 300.0 if report.duration_s >= 1800 else report.duration_s / 12
    series = {"redis_used_bytes": lambda s: s.redis_used_bytes,
              "oldest_outstanding_s": lambda s: s.oldest_outstanding_s,
              "p99_latency_s": lambda s: s.p99_latency_s}
    for name in sorted({n for s in samples for n in s.rss_bytes}):
        series[f"rss:{name}"] = lambda s, n=name: s.rss_bytes.get(n) or None
    for name, key in series.items():
        g = growth(samples, key, first, last)
        if g is not None:
            report.growth[name] = round(g, 4)


def plot(report: Report, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    t = [s.t / 60 for s in report.samples]
    axes[0].plot(t, [s.redis_used_bytes / 2**20 for s in report.samples])
    axes[0].set_ylabel("Redis used MiB")
    for name in sorted({n for s in report.samples for n in s.rss_bytes}):
        axes[1].plot(t, [s.rss_bytes.get(name, 0) / 2**20 for s in report.samples], label=name)
    axes[1].set_ylabel("RSS MiB")
    axes[1].legend(fontsize=7, ncol=3)
    axes[2].plot(t, [s.oldest_outstanding_s for s in report.samples], label="oldest outstanding")
    axes[2].plot(t, [s.p99_latency_s or 0 for s in report.samples], label="p99 latency")
    axes[2].set_ylabel("s")
    axes[2].set_xlabel("minutes")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=3600.0, help="seconds of load")
    ap.add_argument("--update-every", type=float, default=240.0, help="seconds between weight updates")
    ap.add_argument("--kill-every", type=float, default=300.0, help="seconds between process kills")
    ap.add_argument("--sample-every", type=float, default=15.0, help="seconds between samples")
    ap.add_argument("--inflight", type=int, default=200, help="sessions the trainer keeps in flight")
    ap.add_argument("--sessions", type=int, default=400_000, help="at most this many")
    ap.add_argument("--drain-timeout", type=float, default=180.0,
                    help="seconds after the load ends to wait for every result")
    ap.add_argument("--time-scale", type=float, default=5.0, help="engines' simulated s per wall s")
    ap.add_argument("--kv-tokens", type=int, default=60_000, help="KV tokens per engine")
    ap.add_argument("--session-retention-s", type=float, default=300.0,
                    help="how long an ended session's state is kept (the namespace's "
                         "`set_session_retention`; shorter than the 10-minute warm-up, so Redis "
                         "reaches its steady state within it)")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--plot", help="write a PNG of the samples here")
    args = ap.parse_args()
    for name in ("duration", "update_every", "kill_every", "sample_every", "session_retention_s"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')}: must be positive")
    report = run(args)
    print(json.dumps({k: v for k, v in asdict(report).items() if k != "samples"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2))
    if args.plot:
        plot(report, args.plot)
    ok = report.lost == report.duplicated == 0 and all(
        g <= 0.05 for n, g in report.growth.items() if n != "p99_latency_s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(run_until_interrupted(main, "soak"))
