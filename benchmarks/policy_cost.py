"""What one `decide()` costs the live broker, which calls it on every event (issue 7).

Two cases on hand-built snapshots of paper-mixed-like sessions (rlvr groups of 16 with 150-token
prompts, rlhf groups of 4, agentic groups of 8 behind a 3,000-token shared system prompt):

- steady: 1,000 pending, 16 backends of 690k KV tokens, ~40 resident sessions each, room for a
  few dozen admissions; each call brings one completion and one backend's fresh heartbeat
  (16 backends beating at 1 Hz against ~16 events/s); the predictors are warm. Target: median
  ≤ 1 ms at 16 backends, ≤ 5 ms at 256 (`--backends 256`). `--all-fresh` makes every backend's
  heartbeat fresh on every call (the worst case).
- cold: an empty fleet and 1,000 pending, admitted in one call. Target: ≤ 50 µs per admission.

Usage: python benchmarks/policy_cost.py [--policy misa_t] [--backends 16] [--calls 300] [--all-fresh]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import replace

from broker.policies import make_policy
from broker.policies.base import (
    BackendView,
    Completion,
    PendingItem,
    Policy,
    ResidentSession,
    Snapshot,
    Telemetry,
)
from broker.policies.misa_t_control import AimdParams

CAPACITY = 690_000
MIX = {"rlvr": 0.5, "rlhf": 0.3, "agentic": 0.2}
SHAPE = {  # group size, max_tokens, max_turns, prompt tokens, typical output
    "rlvr": (16, 16_384, 1, 150, 4_000),
    "rlhf": (4, 1_024, 1, 170, 300),
    "agentic": (8, 4_096, 50, 3_700, 300),
}
SYSTEM = tuple(range(10_000, 13_000))


def make_pending(n: int, rng: random.Random) -> dict[str, tuple[PendingItem, ...]]:
    out: dict[str, list[PendingItem]] = {w: [] for w in MIX}
    g = 0
    while sum(map(len, out.values())) < n:
        w = rng.choices(list(MIX), weights=list(MIX.values()))[0]
        size, max_tokens, max_turns, prompt, _ = SHAPE[w]
        body = tuple(rng.randrange(150_000) for _ in range(prompt - (len(SYSTEM) if w == "agentic" else 0)))
        prefix = SYSTEM + body if w == "agentic" else body
        for m in range(size):
            out[w].append(PendingItem(
                session_id=f"{w}-g{g}-{m}", workload=w, group_id=f"{w}-g{g}", group_size=size,
                prompt_tokens=len(prefix), prefix=prefix, max_tokens=max_tokens,
                max_turns=max_turns, turn=0, home_backend=None, enqueued_at=float(g),
            ))
        g += 1
    return {w: tuple(v) for w, v in out.items()}


def make_resident(b: int, count: int, rng: random.Random) -> tuple[ResidentSession, ...]:
    out = []
    for i in range(count):
        w = rng.choices(list(MIX), weights=list(MIX.values()))[0]
        _, max_tokens, max_turns, prompt, typical = SHAPE[w]
        generated = rng.randrange(1, typical * 2)
        context = prompt + generated + (rng.randrange(0, 20_000) if w == "agentic" else 0)
        out.append(ResidentSession(
            session_id=f"r{b}-{i}", workload=w, group_id=None, reserved_tokens=context + typical,
            prompt_tokens=prompt, context_tokens=context, generated_tokens=generated,
            turn=rng.randrange(1, 10) if w == "agentic" else 1, max_tokens=max_tokens,
            max_turns=max_turns, waiting_on_tool=w == "agentic" and rng.random() < 0.3,
            admitted_at=0.0,
        ))
    return tuple(out)


def completion(i: int, rng: random.Random) -> Completion:
    w = rng.choices(list(MIX), weights=list(MIX.values()))[0]
    _, max_tokens, max_turns, prompt, typical = SHAPE[w]
    turns = rng.randrange(3, 40) if max_turns > 1 else 1
    outs = tuple(min(max_tokens, int(rng.lognormvariate(0, 0.8) * typical)) for _ in range(turns))
    return Completion(
        session_id=f"done-{i}", workload=w, backend_id="b0", prompt_tokens=prompt,
        output_tokens=sum(outs), turn_output_tokens=outs, turns=turns,
        tool_wait_s=2.0 * (turns - 1), kv_token_seconds=1e6 * turns, admitted_at=0.0,
        finished_at=float(i), truncated=False,
    )


# Between MISA-T's target usage and its watermark, so α holds still and the room stays a few dozen.
HELD_USAGE = (AimdParams().kv_target + AimdParams().kv_high) / 2


def telemetry(at: float) -> Telemetry:
    return Telemetry(at=at, kv_usage=HELD_USAGE, running=30, waiting=0, preemptions_total=0,
                     prefix_queries_total=0, prefix_hits_total=0)


def fleet(residents: list[tuple[ResidentSession, ...]], beats: list[float], alpha: dict[str, float],
          cache: dict[int, BackendView] | None = None) -> tuple[BackendView, ...]:
    """The views a snapshot carries. With `cache`, a backend whose residents, heartbeat and α
    did not change keeps its view object, as the live broker's `ViewCache` keeps it."""
    out = []
    for b in range(len(residents)):
        a = alpha.get(f"b{b}", 1.0)
        old = cache.get(b) if cache is not None else None
        if (old is not None and old.sessions is residents[b] and old.alpha == a
                and old.telemetry is not None and old.telemetry.at == beats[b]):
            out.append(old)
            continue
        view = BackendView(backend_id=f"b{b}", capacity_tokens=CAPACITY, max_model_len=65_536,
                           healthy=True, alpha=a, telemetry=telemetry(beats[b]),
                           sessions=residents[b])
        if cache is not None:
            cache[b] = view
        out.append(view)
    return tuple(out)


def warm(policy: Policy, pending, rng: random.Random, backends: int) -> None:
    """Let the policy see every workload once and learn from 200 completions, with no backend
    in sight: a backend MISA-T first sees while nothing is learned starts at α's guard (a cold
    start), and the steady state measured here is that of a fleet met with warm predictors."""
    small = {w: items[:1] for w, items in pending.items()}
    policy.decide(Snapshot(now=0.0, pending=small, backends=(), mixture_target=MIX, consumed={}))
    done = tuple(completion(i, rng) for i in range(200))
    policy.decide(Snapshot(now=0.0, pending={}, backends=(), mixture_target=MIX, consumed={},
                           new_completions=done))


def steady(name: str, calls: int, all_fresh: bool, seed: int, backends: int
           ) -> tuple[list[float], float]:
    rng = random.Random(seed)
    pool = make_pending(1_000 + 200 * calls, rng)  # arrivals refill what each call admits
    pending = {w: items[:500 if w == "rlvr" else 250] for w, items in pool.items()}
    later = {w: list(items[len(pending[w]):]) for w, items in pool.items()}
    policy = make_policy(name, **true_lengths_params(name))
    warm(policy, pending, rng, backends)
    # ~40 residents per backend, topped up so that each backend has room for about three
    # typical admissions under its reservations: a few dozen across the fleet.
    residents = []
    for b in range(backends):
        rs = list(make_resident(b, 40, rng))
        total = sum(r.reserved_tokens for r in rs)
        filler = CAPACITY - 8_000 - total
        if filler > 0:
            rs.append(ResidentSession(
                session_id=f"fill{b}", workload="rlvr", group_id=None, reserved_tokens=filler,
                prompt_tokens=150, context_tokens=filler, generated_tokens=filler - 150, turn=1,
                max_tokens=max(filler, 16_384), max_turns=1, waiting_on_tool=False, admitted_at=0.0,
            ))
        residents.append(tuple(rs))
    beats = [0.0] * backends
    ledger_alpha: dict[str, float] = {}  # what the ledger holds: each decision's α changes
    views: dict[int, BackendView] = {}
    times, admitted = [], 0
    consumed = {w: 0 for w in MIX}
    for i in range(calls):
        now = 1.0 + i / 16.0
        for b in range(backends) if all_fresh else (i % backends,):
            # A fresh heartbeat reports ~40 tokens/s of decode progress since the last one.
            progress = int(40 * (now - beats[b]))
            residents[b] = tuple(
                r if r.waiting_on_tool else replace(
                    r, generated_tokens=r.generated_tokens + progress,
                    context_tokens=r.context_tokens + progress)
                for r in residents[b])
            beats[b] = now
        snap = Snapshot(now=now, pending=pending, backends=fleet(residents, beats, ledger_alpha, views),
                        mixture_target=MIX, consumed=consumed,
                        new_completions=(completion(10_000 + i, rng),))
        t0 = time.perf_counter_ns()
        decision = policy.decide(snap)
        times.append((time.perf_counter_ns() - t0) / 1e6)
        admitted += len(decision.admissions)
        ledger_alpha.update(decision.alpha)
        gone = {a.session_id for a in decision.admissions}
        for w, items in pending.items():
            kept = [it for it in items if it.session_id not in gone]
            refill = len(items) - len(kept)
            pending[w] = tuple(kept + later[w][:refill])
            del later[w][:refill]
    return times, admitted / calls


def cold(name: str, seed: int, backends: int) -> tuple[float, int]:
    rng = random.Random(seed)
    pending = make_pending(1_000, rng)
    policy = make_policy(name, **true_lengths_params(name))
    snap = Snapshot(now=0.0, pending=pending, backends=fleet([()] * backends, [0.0] * backends, {}),
                    mixture_target=MIX, consumed={})
    t0 = time.perf_counter_ns()
    decision = policy.decide(snap)
    elapsed = (time.perf_counter_ns() - t0) / 1e3
    n = len(decision.admissions)
    return elapsed / max(n, 1), n


def true_lengths_params(name: str) -> dict:
    return {"true_output_lengths": lambda sid: (4_000,)} if name == "misa_t-true-lengths" else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="misa_t")
    ap.add_argument("--backends", type=int, default=16)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--all-fresh", action="store_true", help="every backend beats on every call")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if args.backends < 1:
        ap.error("--backends: must be at least 1")
    times, per_call = steady(args.policy, args.calls, args.all_fresh, args.seed, args.backends)
    target = 1.0 if args.backends <= 16 else 5.0
    times.sort()
    p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
    print(f"{args.policy} steady, {args.backends} backends"
          f" ({'all fresh' if args.all_fresh else 'one fresh heartbeat'} per call):"
          f" median {statistics.median(times):.3f} ms, p99 {p99:.3f} ms,"
          f" {per_call:.1f} admissions/call (target: median <= {target:g} ms)")
    per_admission, n = cold(args.policy, args.seed, args.backends)
    print(f"{args.policy} cold start: {n} admissions in one call, {per_admission:.1f} us per admission"
          " (target: <= 50 us)")


if __name__ == "__main__":
    main()
