"""How fast the simulated engine runs: one H200 engine (h200-30b-a3b) serving N requests on the
virtual clock, advanced in bulk between events.

Workload: 1,024-token random prompts (no shared prefixes beyond chance), output lengths
lognormal with median 3,000 tokens and log-sigma 0.8 (mean ≈ 3,000·e^0.32 ≈ 4.1k), capped at
32k, passed as `sim_output_len`. Arrivals: all at t=0 by default, or a Poisson process
(`--rate R` requests per virtual second).

    python3 benchmarks/engine_speed.py [--requests 2000] [--seed 0] [--rate R] [--json]

Prints simulated generated tokens per wall-clock second and per CPU second of this process
(the machine may be shared), simulated time, steps, preemptions and the prefix hit rate.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim.engine.core import EngineCore  # noqa: E402
from sim.engine.profiles import get_profile  # noqa: E402
from sim.engine.request import EngineRequest  # noqa: E402

PROMPT_LEN = 1024
MEDIAN_OUT, SIGMA_OUT, MAX_OUT = 3000, 0.8, 32_768


def make_requests(n: int, seed: int, rate: float | None) -> list[EngineRequest]:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(512, 151_000, size=(n, PROMPT_LEN)).tolist()
    outs = np.minimum(np.rint(MEDIAN_OUT * np.exp(SIGMA_OUT * rng.standard_normal(n))), MAX_OUT)
    outs = np.maximum(outs, 1).astype(int).tolist()
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n)) if rate else np.zeros(n)
    return [EngineRequest(f"r{i}", prompts[i], MAX_OUT, output_len=outs[i], arrival_time=float(arrivals[i]))
            for i in range(n)]


def run(n: int, seed: int, rate: float | None) -> dict:
    reqs = make_requests(n, seed, rate)
    core = EngineCore(get_profile("h200-30b-a3b"), seed=seed)
    w0, c0 = time.perf_counter(), time.process_time()
    for r in reqs:
        core.add_request(r)
    done = core.run_until_idle()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    s = core.stats()
    assert len(done) == n and s.generation_tokens_total >= sum(r.output_len for r in reqs)
    queries = s.prefix_queries_total + s.preempted_prefix_queries_total
    hits = s.prefix_hits_total + s.preempted_prefix_hits_total
    return {
        "requests": n, "seed": seed, "arrivals": f"poisson {rate}/s" if rate else "all at t=0",
        "generated_tokens": s.generation_tokens_total,
        "mean_output_len": sum(r.output_len for r in reqs) / n,
        "wall_s": wall, "cpu_s": cpu,
        "tokens_per_wall_s": s.generation_tokens_total / wall,
        "tokens_per_cpu_s": s.generation_tokens_total / cpu,
        "simulated_s": s.now, "steps": s.steps_total, "preemptions": s.num_preemptions_total,
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "prefix_hit_rate_preempted": (s.preempted_prefix_hits_total / s.preempted_prefix_queries_total
                                      if s.preempted_prefix_queries_total else 0.0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate", type=float, default=None, help="Poisson arrivals per virtual second")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    out = run(a.requests, a.seed, a.rate)
    if a.json:
        print(json.dumps(out))
        return
    print(f"h200-30b-a3b · {out['requests']} requests ({out['arrivals']}), seed {out['seed']}, "
          f"mean output {out['mean_output_len']:.0f} tokens")
    print(f"  generated tokens     {out['generated_tokens']:,}")
    print(f"  tokens / wall s      {out['tokens_per_wall_s']:,.0f}   (wall {out['wall_s']:.2f} s)")
    print(f"  tokens / CPU s       {out['tokens_per_cpu_s']:,.0f}   (CPU {out['cpu_s']:.2f} s)")
    print(f"  simulated time       {out['simulated_s']:,.1f} s   steps {out['steps']:,}   "
          f"preemptions {out['preemptions']:,}")
    print(f"  prefix hit rate      {out['prefix_hit_rate']:.3f} "
          f"(recomputes after preemption: {out['prefix_hit_rate_preempted']:.3f})")


if __name__ == "__main__":
    main()
