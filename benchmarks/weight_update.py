"""What a weight update costs while rollouts run (issue 15): pause and resume latency, and the
generated tokens kept or thrown away, for each of vLLM's pause modes.

    python3 benchmarks/weight_update.py --workers 8 --modes keep,wait,abort --repeats 2

Per run, from nothing: a Redis (the one at $REDIS_URL if it answers, else a private one), a
fresh namespace, `--workers` simulated engines (`rollout-broker sim-engine`, ×`--time-scale`)
each with a `rollout-broker worker --engine attach:URL`, and `rollout-broker broker`. The
trainer (this process) enqueues `--sessions` single-turn sessions of `--output` tokens each,
lets them run for `--warmup` seconds, then:

1. `pause(mode)`: the time from the call to its return, which is when every live worker has
   paused its engine and acknowledged (the broker has stopped admitting before that);
2. enqueues `--late` more sessions (they must wait), holds the pause for `--hold` seconds (the
   trainer loading weights), then `resume(1)`: the time from the call to the first admission
   after it (the earliest `admitted_at` of the late sessions);
3. collects every result and reads the engines' own counters: tokens the engines generated
   (`vllm:generation_tokens_total`) against tokens delivered in results; the difference is
   what the update threw away; and the tokens generated between `pause` returning and the
   resume (none, if every engine is paused). Sessions lost or delivered twice are counted too.

Everything runs on this machine's CPUs, the engines included; latencies are wall-clock.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from broker.client import RolloutClient  # noqa: E402
from rollout_broker.demo import Children, run_until_interrupted  # noqa: E402
from broker.redis_conn import delete_namespace  # noqa: E402
from broker.redis_server import ensure_redis, free_port  # noqa: E402
from broker.session import Session, SessionState  # noqa: E402
from workers.engine import parse_metrics, wait_healthy  # noqa: E402


def sessions(n: int, tag: str, output: int, rng: random.Random) -> list[Session]:
    return [Session(session_id=f"{tag}-{i}", workload="rlvr",
                    prompt_token_ids=[rng.randrange(1000, 100_000) for _ in range(200)],
                    max_tokens=output + 512, metadata={"sim_output_tokens": str(output)})
            for i in range(n)]


def generated(urls: list[str]) -> int:
    return sum(parse_metrics(httpx.get(f"{u}/metrics", timeout=10).text).generation_tokens_total
               for u in urls)


def run_once(args: argparse.Namespace, mode: str, repeat: int, redis_url: str) -> dict:
    namespace = f"wu-{uuid.uuid4().hex[:8]}"
    children = Children(Path(tempfile.mkdtemp(prefix="rb-weight-update-")))
    rng = random.Random(repeat)
    common = ["--redis-url", redis_url, "--namespace", namespace, "--log-level", "WARNING"]
    backends = [f"w{i}" for i in range(args.workers)]
    urls = []
    client = RolloutClient(redis_url, namespace)
    try:
        for i, b in enumerate(backends):
            port = free_port()
            urls.append(f"http://127.0.0.1:{port}")
            children.start(f"engine-{b}", ["sim-engine", "--port", str(port), "--profile",
                                           args.profile, "--time-scale", repr(args.time_scale),
                                           "--seed", str(i), "--kv-tokens", str(args.kv_tokens)])
        for url, b in zip(urls, backends):
            wait_healthy(url, 60.0, children.procs[f"engine-{b}"])
        for b, url in zip(backends, urls):
            children.start(b, ["worker", "--backend-id", b, "--engine", f"attach:{url}",
                               "--time-scale", repr(args.time_scale), *common])
        children.start("broker", ["broker", "--policy", args.policy, "--lease-s", "2", *common])
        deadline = time.monotonic() + 60
        while not all(client.status()["backends"].get(b, {}).get("healthy") for b in backends):
            if time.monotonic() > deadline or children.dead():
                raise RuntimeError(f"fleet not ready; logs in {children.logdir}")
            time.sleep(0.2)
        first = sessions(args.sessions, "s", args.output, rng)
        client.enqueue(first)
        time.sleep(args.warmup)
        t0 = time.monotonic()
        paused = client.pause(mode, timeout=120.0)
        pause_s = time.monotonic() - t0
        at_pause = generated(urls)
        late = sessions(args.late, "late", args.output, rng)
        client.enqueue(late)
        time.sleep(args.hold)
        frozen = generated(urls) - at_pause
        resumed_at = time.time()
        client.resume(1)
        results: list = []
        deadline = time.monotonic() + args.timeout
        want = len(first) + len(late)
        while len(results) < want and time.monotonic() < deadline:
            results += client.results(want - len(results), timeout=1.0)
        client.ack()
        with redis.Redis.from_url(redis_url) as r:
            admitted = [float(raw) for s in late
                        if (raw := r.hget(client.keys.session(s.session_id), "admitted_at"))]
        engine_tokens = generated(urls)
        ids = [x.session_id for x in results]
        delivered = sum(x.output_tokens for x in results)
        cut = sum(1 for x in results if len(x.turn_records) > 1)
        return {
            "mode": mode, "repeat": repeat, "workers": len(paused),
            "pause_s": pause_s,
            "resume_to_admission_s": (min(admitted) - resumed_at) if admitted else None,
            "tokens_while_paused": frozen,
            "engine_tokens": engine_tokens, "delivered_tokens": delivered,
            "thrown_away_tokens": engine_tokens - delivered,
            "sessions": want, "results": len(results), "lost": want - len(set(ids)),
            "duplicated": len(ids) - len(set(ids)),
            "failed": sum(1 for x in results if x.status != SessionState.done),
            "turns_cut_by_the_pause": cut,
            "versions": sorted({t.policy_version for x in results for t in x.turn_records}),
        }
    finally:
        children.stop()
        client.close()
        try:  # leave the Redis as it was (it may be someone else's)
            with redis.Redis.from_url(redis_url) as r:
                delete_namespace(r, client.keys.prefix)
        except redis.RedisError as exc:
            print(f"weight_update: namespace {namespace} not deleted ({exc})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--modes", default="keep,wait,abort")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sessions", type=int, default=64, help="sessions running at the pause")
    ap.add_argument("--late", type=int, default=16, help="sessions enqueued while paused")
    ap.add_argument("--output", type=int, default=2000, help="output tokens per session")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--hold", type=float, default=1.0, help="seconds the pause lasts")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--profile", default="h100-8b")
    ap.add_argument("--kv-tokens", type=int, default=60_000)
    ap.add_argument("--policy", default="misa_t")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to collect results")
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("keep", "wait", "abort")]
    if bad or args.workers < 1 or args.repeats < 1:
        ap.error(f"--modes: unknown {bad}" if bad else "--workers and --repeats must be >= 1")
    handle = ensure_redis()
    runs = []
    try:
        for repeat in range(args.repeats):
            for mode in modes:
                rec = run_once(args, mode, repeat, handle.url)
                runs.append(rec)
                print(json.dumps(rec), flush=True)
    finally:
        handle.close()
    print(f"\n{args.workers} workers, {args.sessions} sessions of {args.output} tokens running "
          f"at the pause, ×{args.time_scale:g}")
    print("| mode | pause → all paused (ms) | resume → admission (ms) | generated while paused "
          "| engine tokens | delivered | thrown away | turns cut | lost / duplicated / failed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    def col(rs: list[dict], key: str, scale: float = 1.0) -> str:
        vals = [r[key] for r in rs if r[key] is not None]
        return " / ".join(f"{v * scale:.0f}" for v in vals) or "-"

    for mode in modes:
        rs = [r for r in runs if r["mode"] == mode]
        bad = "{} / {} / {}".format(*(sum(r[k] for r in rs) for k in ("lost", "duplicated",
                                                                      "failed")))
        cells = [mode, col(rs, "pause_s", 1000), col(rs, "resume_to_admission_s", 1000),
                 col(rs, "tokens_while_paused"), col(rs, "engine_tokens"),
                 col(rs, "delivered_tokens"), col(rs, "thrown_away_tokens"),
                 col(rs, "turns_cut_by_the_pause"), bad]
        print("| " + " | ".join(cells) + " |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_until_interrupted(main, "weight_update"))
