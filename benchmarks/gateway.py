"""The session gateway, measured: end to end with the example agent, its overhead per call
against calling the engine directly, and the calls/s one gateway process sustains.

    python3 benchmarks/gateway.py --episodes 256 --json gateway.json

Every process is its own (`rollout-broker sim-engine`, `worker`, `broker`, `gateway`), on this
machine, with Redis at $REDIS_URL (or a private one). Three parts:

1. **end to end**: `--episodes` concurrent episodes of examples/agent_gateway.py's calculator
   agent (plain `openai`, function calling), the simulated model's truth drawn from the demo
   scenario's agentic workload, the agent's tool taking that workload's tool time. Every result
   is checked against the engines' own journals (`sim-engine --journal`): token ids equal to
   what they consumed and produced, loss mask exact, one logprob per model token.
2. **overhead**: the same concurrency, side by side in one run, alternating rounds: agents
   through the gateway, and agents calling the engines' `/v1/chat/completions` directly with
   the same messages and output lengths. Per-call latency percentiles of each arm and their
   difference (a call's first call, which waits for admission, is reported apart), and the
   gateway's own time per call from its `Server-Timing` header (total − engine − admission).
3. **throughput**: one-token outputs, as many calls as the gateway takes: calls/s and the
   gateway process's CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.chaos import Proc, wait_http  # noqa: E402
from broker.client import AsyncRolloutClient, RolloutClient  # noqa: E402
from broker.keys import Keys  # noqa: E402
from broker.redis_conn import delete_namespace  # noqa: E402
from broker.redis_server import ensure_redis, free_port  # noqa: E402
from broker.session import SessionResult  # noqa: E402
from examples import agent_gateway as example  # noqa: E402
from sim.scenario import load_scenario  # noqa: E402
from sim.workloads.generators import generate_group  # noqa: E402
from workers.engine_http import engine_client  # noqa: E402

NAMESPACE = "gwbench"


@dataclass
class Report:
    started: str
    args: dict
    e2e: dict = field(default_factory=dict)
    overhead: dict = field(default_factory=dict)
    throughput: dict = field(default_factory=dict)


class Fleet:
    """Engines (with journals), a worker each, the broker and one gateway, as processes."""

    def __init__(self, workdir: Path, redis_url: str, engines: int, time_scale: float,
                 kv_tokens: int, admission_timeout_s: float, tokenizer: str) -> None:
        self.redis_url = redis_url
        self.env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.engine_ports = [free_port() for _ in range(engines)]
        self.gateway_port = free_port()
        self.procs: list[Proc] = []
        self.gateway: Proc | None = None
        self.workdir, self.time_scale, self.kv_tokens = workdir, time_scale, kv_tokens
        self.admission_timeout_s = admission_timeout_s
        self.tokenizer = tokenizer

    @property
    def engine_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.engine_ports]

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def start(self) -> None:
        w = self.workdir
        for i, port in enumerate(self.engine_ports):
            self.procs.append(Proc(f"engine-{i}", [
                "sim-engine", "--port", str(port), "--profile", "h100-8b", "--time-scale",
                repr(self.time_scale), "--kv-tokens", str(self.kv_tokens), "--seed", str(i),
                "--journal", "200000"], w / f"engine-{i}.log").start(self.env))
        for url in self.engine_urls:
            wait_http(f"{url}/health")
        for i, url in enumerate(self.engine_urls):
            self.procs.append(Proc(f"worker-{i}", [
                "worker", "--backend-id", f"w{i}", "--engine", f"attach:{url}", "--redis-url",
                self.redis_url, "--namespace", NAMESPACE, "--log-level", "WARNING"],
                w / f"worker-{i}.log").start(self.env))
        self.procs.append(Proc("broker", ["broker", "--redis-url", self.redis_url, "--namespace",
                                          NAMESPACE, "--policy", "misa_t", "--log-level",
                                          "WARNING"], w / "broker.log").start(self.env))
        self.gateway = Proc("gateway", [
            "gateway", "--port", str(self.gateway_port), "--redis-url", self.redis_url,
            "--namespace", NAMESPACE, "--admission-timeout", repr(self.admission_timeout_s),
            "--tokenizer", self.tokenizer, "--log-level", "WARNING"],
            w / "gateway.log").start(self.env)
        self.procs.append(self.gateway)
        wait_http(f"{self.gateway_url}/healthz")
        with RolloutClient(self.redis_url, NAMESPACE) as c:
            deadline = time.monotonic() + 60
            while not all(b.get("healthy") for b in c.status()["backends"].values()) or \
                    len(c.status()["backends"]) < len(self.engine_ports):
                if time.monotonic() > deadline:
                    raise RuntimeError("gateway bench: the workers did not register in 60 s")
                time.sleep(0.2)

    def restart_gateway(self) -> None:
        """kill -9 the gateway, then start a new one on the same port."""
        assert self.gateway is not None
        self.gateway.kill()
        self.procs.remove(self.gateway)
        self.gateway = Proc("gateway", self.gateway.args, self.gateway.log).start(self.env)
        self.procs.append(self.gateway)
        wait_http(f"{self.gateway_url}/healthz")

    def close(self) -> None:
        import signal
        for p in self.procs:
            p.signal(signal.SIGTERM)
        for p in self.procs:
            if p.process is not None:
                try:
                    p.process.wait(timeout=15)
                except Exception:  # noqa: BLE001 - killed below
                    pass
            p.signal(signal.SIGKILL)

    def gateway_cpu_s(self) -> float:
        assert self.gateway is not None and self.gateway.process is not None
        fields = Path(f"/proc/{self.gateway.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# -- 1. end to end --------------------------------------------------------------------------------

async def e2e(fleet: Fleet, episodes: int, seed: int, time_scale: float,
              kill_after_s: float) -> dict:
    rng = random.Random(seed)
    scenario = load_scenario(str(ROOT / "scenarios" / "demo.yaml"))
    truths = [generate_group(scenario, "agentic", 10_000 + i)[0].truth for i in range(episodes)]
    t0 = time.monotonic()
    trainer = asyncio.Semaphore(64)  # the trainer's calls in flight (its Redis pool holds 100)
    async with AsyncRolloutClient(fleet.redis_url, NAMESPACE) as client:
        async def one(i: int) -> None:
            truth = truths[i]
            a, b = rng.randrange(100), rng.randrange(100)
            async with trainer:
                base = await client.open_episode({
                    "session_id": f"e2e-{i}", "workload": "agentic",
                    "group_id": f"e2e-g{i // 4}", "group_size": 4, "max_tokens": 4096,
                    "max_turns": truth.turns,
                    "metadata": {"sim_turns": truth.turns,
                                 "sim_output_tokens": ",".join(map(str, truth.output_tokens))}},
                    fleet.gateway_url)
            wait = statistics.fmean(truth.tool_latency_s) / time_scale if truth.tool_latency_s else 0.0
            answer = await example.calculator_agent(base, f"What is {a} + {b}?",
                                                    max_turns=truth.turns, tool_wait_s=wait)
            async with trainer:
                await client.close_episode(f"e2e-{i}", example.reward(answer, a + b))

        async def killer() -> None:
            await asyncio.sleep(kill_after_s)
            await asyncio.to_thread(fleet.restart_gateway)

        kill = asyncio.create_task(killer()) if kill_after_s > 0 else None
        await asyncio.gather(*(one(i) for i in range(episodes)))
        wall = time.monotonic() - t0
        killed = kill is not None and kill.done()
        if kill is not None and not kill.done():
            kill.cancel()
        results: list[SessionResult] = []
        while len(results) < episodes:
            batch = await client.results(episodes, timeout=10.0)
            if not batch:
                break
            results += batch
        await client.ack()
    journals: list[dict] = []
    async with httpx.AsyncClient(timeout=60) as http:
        for url in fleet.engine_urls:
            journals += (await http.get(f"{url}/sim/journal")).json()
    by_episode: dict[str, list[dict]] = {}
    for r in journals:
        sid, _, tail = r["request_id"].rpartition("-t")
        by_episode.setdefault(sid, []).append(r)
    exact = mask_ok = logprobs_ok = reruns = 0
    for res in results:
        reqs = sorted(by_episode.get(res.session_id, []),
                      key=lambda r: tuple(int(x) for x in
                                          r["request_id"].rpartition("-t")[2].split("-p")))
        traj = res.trajectory()
        # Each record against the engine's requests in order; a call the gateway's kill cut
        # short, which the agent's retry ran again, is in the journal twice (when the engine
        # had finished it): the record is the run whose output it holds.
        at, i, ok = 0, 0, True
        for rec in res.turn_records:
            at += len(rec.input_token_ids)
            while i < len(reqs) and not (reqs[i]["prompt_token_ids"] == traj.token_ids[:at]
                                         and reqs[i]["output_token_ids"] == rec.output_token_ids):
                i, reruns = i + 1, reruns + 1
            ok &= i < len(reqs)
            i += 1
            at += len(rec.output_token_ids)
        exact += ok and at == len(traj.token_ids)
        model = sum(len(r.output_token_ids) for r in res.turn_records)
        mask_ok += sum(traj.loss_mask) == model and all(
            traj.loss_mask[i] == 0 for i in range(len(traj.token_ids))
            if traj.policy_versions[i] == -1)
        logprobs_ok += all(r.output_logprobs is not None
                           and len(r.output_logprobs) == len(r.output_token_ids)
                           for r in res.turn_records)
    calls = sum(r.turns for r in results)
    return {"episodes": episodes, "results": len(results), "engine_requests_not_kept": reruns,
            "distinct_results": len({r.session_id for r in results}), "calls": calls,
            "token_exact": exact, "loss_mask_exact": mask_ok, "logprobs_one_per_token": logprobs_ok,
            "multi_turn": sum(r.turns > 1 for r in results), "wall_s": round(wall, 1),
            "gateway_killed_mid_run": killed,
            "calls_per_s": round(calls / wall, 1)}


# -- 2. overhead ----------------------------------------------------------------------------------

async def agent_calls(http: httpx.AsyncClient, url: str, body_extra: dict, calls: int,
                      out_tokens: int, lat: list[float], first: list[float],
                      timings: list[tuple[float, ...]]) -> None:
    """One agent: `calls` chat calls, the history resent each time, `out_tokens` per reply."""
    messages: list[dict] = [{"role": "user", "content": "count to ten"}]
    for k in range(calls):
        body = {"model": "m", "messages": messages, "max_tokens": out_tokens, **body_extra}
        for attempt in range(3):  # a keep-alive connection the server closed as it was reused
            t = time.perf_counter()
            try:
                r = await http.post(url, json=body)
                break
            except (httpx.ReadError, httpx.RemoteProtocolError):
                if attempt == 2:
                    raise
        dt = time.perf_counter() - t
        r.raise_for_status()
        (first if k == 0 else lat).append(dt)
        st = r.headers.get("server-timing")
        if st and k:
            parts = dict(p.strip().split(";dur=") for p in st.split(","))
            timings.append(tuple(float(parts[k]) / 1e3
                                 for k in ("admission", "render", "engine", "total")))
        msg = r.json()["choices"][0]["message"]
        messages += [{"role": "assistant", "content": msg.get("content") or ""},
                     {"role": "user", "content": "go on"}]


async def overhead(fleet: Fleet, episodes: int, calls: int, out_tokens: int, rounds: int) -> dict:
    arms = {"gateway": {"lat": [], "first": []}, "direct": {"lat": [], "first": []}}
    timings: list[tuple[float, ...]] = []
    placed: dict[int, int] = {}  # episode index -> the engine the broker placed it on
    gateway_cpu = 0.0
    # The load generator's client: the workers' (httpx's own pool would spend more CPU in this
    # process than the gateway does; both arms use it).
    async with engine_client(600) as http, AsyncRolloutClient(fleet.redis_url, NAMESPACE) as client:
        model = (await http.get(f"{fleet.engine_urls[0]}/v1/models")).json()["data"][0]["id"]
        for rnd in range(rounds):
            for arm in ("gateway", "direct") if rnd % 2 == 0 else ("direct", "gateway"):
                jobs = []
                for i in range(episodes):
                    if arm == "gateway":
                        sid = f"ov{rnd}-{i}"
                        base = await client.open_episode({
                            "session_id": sid, "workload": "agentic", "max_tokens": out_tokens,
                            "max_turns": calls, "metadata": {"sim_output_tokens": out_tokens}},
                            fleet.gateway_url)
                        url, extra = f"{base}/chat/completions", {}
                    else:  # the engine the broker placed the same episode of the last
                        # gateway round on (round-robin before there was one): the arms differ
                        # by the gateway alone, not by where the calls ran
                        engine = placed.get(i, i % len(fleet.engine_urls))
                        url = f"{fleet.engine_urls[engine]}/v1/chat/completions"
                        extra = {"model": model, "sim_output_len": out_tokens, "logprobs": True}
                    jobs.append(agent_calls(http, url, extra, calls, out_tokens,
                                            arms[arm]["lat"], arms[arm]["first"], timings))
                cpu0 = fleet.gateway_cpu_s()
                await asyncio.gather(*jobs)
                if arm == "gateway":
                    gateway_cpu += fleet.gateway_cpu_s() - cpu0
                    r = redis.Redis.from_url(fleet.redis_url)
                    k = Keys(NAMESPACE)
                    for i in range(episodes):
                        b = r.hget(k.session(f"ov{rnd}-{i}"), "backend")
                        if b is not None:
                            placed[i] = int(b.decode().removeprefix("w"))
                    r.close()
                    for i in range(episodes):
                        await client.close_episode(f"ov{rnd}-{i}", 0.0)
        while await client.results(4096, timeout=1.0):
            pass
        await client.ack()
    out: dict = {"episodes": episodes, "calls_per_episode": calls, "output_tokens": out_tokens,
                 "rounds": rounds}
    for arm, d in arms.items():
        out[arm] = {"calls": len(d["lat"]), "p50_ms": _ms(pct(d["lat"], 0.5)),
                    "p99_ms": _ms(pct(d["lat"], 0.99)), "first_call_p50_ms": _ms(pct(d["first"], 0.5))}
    own = [t - a - r - e for a, r, e, t in timings]
    out["render_p50_ms"] = _ms(pct([r for _, r, _, _ in timings], 0.5))
    out["render_p99_ms"] = _ms(pct([r for _, r, _, _ in timings], 0.99))
    out["added_p50_ms"] = _ms(pct(arms["gateway"]["lat"], 0.5) - pct(arms["direct"]["lat"], 0.5))
    out["added_p99_ms"] = _ms(pct(arms["gateway"]["lat"], 0.99) - pct(arms["direct"]["lat"], 0.99))
    out["gateway_cpu_ms_per_call"] = round(
        1e3 * gateway_cpu / (len(arms["gateway"]["lat"]) + len(arms["gateway"]["first"])), 2)
    out["gateway_own_p50_ms"] = _ms(pct(own, 0.5))
    out["gateway_own_p99_ms"] = _ms(pct(own, 0.99))
    return out


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 2)


# -- 3. throughput --------------------------------------------------------------------------------

async def throughput(fleet: Fleet, episodes: int, seconds: float) -> dict:
    done = 0
    stop = time.monotonic() + seconds
    async with engine_client(600) as http, AsyncRolloutClient(fleet.redis_url, NAMESPACE) as client:
        bases = [await client.open_episode({
            "session_id": f"tp-{i}", "workload": "agentic", "max_tokens": 1, "max_turns": 1000,
            "metadata": {"sim_output_tokens": 1}}, fleet.gateway_url) for i in range(episodes)]

        async def agent(base: str) -> None:
            nonlocal done
            messages: list[dict] = [{"role": "user", "content": "a"}]
            while time.monotonic() < stop:
                r = await http.post(f"{base}/chat/completions",
                                    json={"model": "m", "messages": messages})
                r.raise_for_status()
                done += 1
                messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]
                              ["content"] or ""}, {"role": "user", "content": "b"}]

        cpu0, t0 = fleet.gateway_cpu_s(), time.monotonic()
        await asyncio.gather(*(agent(b) for b in bases))
        wall, cpu = time.monotonic() - t0, fleet.gateway_cpu_s() - cpu0
        for i in range(episodes):
            await client.close_episode(f"tp-{i}", 0.0)
        while await client.results(4096, timeout=1.0):
            pass
        await client.ack()
    return {"episodes": episodes, "calls": done, "seconds": round(wall, 1),
            "calls_per_s": round(done / wall, 1), "gateway_cpu_pct": round(100 * cpu / wall, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=256, help="concurrent episodes")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--time-scale", type=float, default=20.0)
    ap.add_argument("--kv-tokens", type=int, default=400_000)
    ap.add_argument("--calls", type=int, default=4, help="overhead: calls per episode")
    ap.add_argument("--out-tokens", type=int, default=32, help="overhead: tokens per reply")
    ap.add_argument("--rounds", type=int, default=4, help="overhead: rounds (arms alternate)")
    ap.add_argument("--throughput-s", type=float, default=30.0)
    ap.add_argument("--parts", default="e2e,overhead,throughput")
    ap.add_argument("--tokenizer", default="sim",
                    help="the gateway's --tokenizer (sim: render in the gateway; engine: ask "
                         "the engines)")
    ap.add_argument("--kill-gateway-after", type=float, default=0.0,
                    help="end to end: kill -9 the gateway this many seconds in, and start "
                         "another (0: no kill)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    report = Report(started=time.strftime("%Y-%m-%d %H:%M:%S"), args=vars(args))
    redis_handle = ensure_redis(os.environ.get("REDIS_URL"))
    with tempfile.TemporaryDirectory(prefix="rb-gateway-bench-") as tmp:
        fleet = Fleet(Path(tmp), redis_handle.url, args.engines, args.time_scale, args.kv_tokens,
                      admission_timeout_s=60.0, tokenizer=args.tokenizer)
        try:
            fleet.start()
            parts = args.parts.split(",")
            if "e2e" in parts:
                report.e2e = asyncio.run(e2e(fleet, args.episodes, args.seed, args.time_scale,
                                             args.kill_gateway_after))
                print("end to end:", json.dumps(report.e2e), flush=True)
            if "overhead" in parts:
                report.overhead = asyncio.run(overhead(fleet, args.episodes, args.calls,
                                                       args.out_tokens, args.rounds))
                print("overhead:", json.dumps(report.overhead), flush=True)
            if "throughput" in parts:
                report.throughput = asyncio.run(throughput(fleet, args.episodes,
                                                           args.throughput_s))
                print("throughput:", json.dumps(report.throughput), flush=True)
        except BaseException:
            log = Path(tmp) / "gateway.log"
            if log.exists():
                print("gateway log (tail):\n" + "\n".join(log.read_text().splitlines()[-40:]),
                      file=sys.stderr)
            raise
        finally:
            fleet.close()
            r = redis.Redis.from_url(redis_handle.url)
            delete_namespace(r, Keys(NAMESPACE).prefix)  # a shared Redis keeps nothing of ours
            r.close()
            redis_handle.close()
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2))
    e = report.e2e
    ok = not e or (e["token_exact"] == e["results"] == e["distinct_results"] == args.episodes)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
