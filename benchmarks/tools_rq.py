"""RQ tool workers against inline tools (issue 16): sessions the demo finishes in the same time.

    python3 benchmarks/tools_rq.py --pairs 4 --duration 20 [--tool-workers 16] [--json PATH]

Each pair runs `rollout-broker demo --duration D` twice, once with `--tools inline` (tool calls
and rewards on threads of each GPU worker) and once with `--tools rq` (the same calls as RQ jobs
on `--tool-workers` `rollout-broker tools` processes), in alternating order (inline first in odd
pairs, rq first in even ones), one after the other on the same Redis (the demo's own choice:
$REDIS_URL if it answers, else a private server). Everything shares this machine's CPUs: the
engines, workers, broker, Redis and, with rq, the tool workers. Reported per run: sessions done
and failed, and output tokens/s, as the demo's summary prints them; per pair: rq's sessions over
inline's; overall: the median of the pair ratios and the ratio of the totals. Target: >= 0.8.

A demo that fails (exit code not 0, or no summary) stops the benchmark with its output's tail.
Ctrl-C or SIGTERM stops the running demo (it stops what it started) and exits 130.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollout_broker.demo import run_until_interrupted  # noqa: E402

SUMMARY_RE = re.compile(r"summary: (\d+) sessions in ([\d.]+)s")
# The summary table's last row: "│ all │ done │ failed │ output tokens │ tok/s │ ..."
ALL_ROW_RE = re.compile(r"│\s*all\s*│\s*([\d,]+)\s*│\s*([\d,]+)\s*│\s*([\d,]+)\s*│\s*([\d,]+)\s*│")


def parse_summary(text: str) -> dict[str, float]:
    """The figures of a demo's printed summary; ValueError when it has none."""
    head = SUMMARY_RE.search(text)
    row = ALL_ROW_RE.search(text[head.end():]) if head else None
    if head is None or row is None:
        raise ValueError("demo output has no summary table")
    done, failed, tokens, tok_s = (int(g.replace(",", "")) for g in row.groups())
    return {"sessions": int(head.group(1)), "seconds": float(head.group(2)), "done": done,
            "failed": failed, "output_tokens": tokens, "tokens_per_s": tok_s}


def one_demo(tools: str, duration: float, tool_workers: int) -> dict[str, float]:
    cmd = [sys.executable, "-m", "rollout_broker.cli", "demo", "--duration", repr(duration),
           "--tools", tools, "--tool-workers", str(tool_workers)]
    env = {**os.environ, "COLUMNS": "200"}  # the summary table's numbers unabridged
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate()
    except BaseException:  # interrupted: the demo stops its own children on SIGTERM
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"demo --tools {tools} exited {proc.returncode}:\n{out[-2000:]}")
    try:
        return {"tools": tools, "load_1m": os.getloadavg()[0], **parse_summary(out)}
    except ValueError as exc:
        raise RuntimeError(f"demo --tools {tools}: {exc}:\n{out[-2000:]}") from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds each demo's trainer runs")
    ap.add_argument("--tool-workers", type=int, default=16)
    ap.add_argument("--json", help="write every run and the ratios here")
    a = ap.parse_args()
    if a.pairs < 1 or a.duration <= 0 or a.tool_workers < 1:
        ap.error("--pairs and --tool-workers must be >= 1 and --duration > 0")
    runs: list[dict] = []
    ratios: list[float] = []
    for pair in range(a.pairs):
        order = ("inline", "rq") if pair % 2 == 0 else ("rq", "inline")
        got = {}
        for tools in order:
            got[tools] = one_demo(tools, a.duration, a.tool_workers)
            runs.append({"pair": pair, **got[tools]})
            r = got[tools]
            print(f"pair {pair + 1}/{a.pairs} {tools:>6}: {r['done']:>5,} done, {r['failed']} "
                  f"failed in {r['seconds']:.1f} s, {r['tokens_per_s']:,} tok/s "
                  f"(load {r['load_1m']:.1f})", flush=True)
        ratios.append(got["rq"]["done"] / max(got["inline"]["done"], 1))
        print(f"pair {pair + 1}/{a.pairs} rq/inline sessions: {ratios[-1]:.2f}", flush=True)
    total = {t: sum(r["done"] for r in runs if r["tools"] == t) for t in ("inline", "rq")}
    overall = total["rq"] / max(total["inline"], 1)
    median = statistics.median(ratios)
    print(f"rq/inline sessions: median of {a.pairs} pairs {median:.2f} "
          f"(range {min(ratios):.2f}-{max(ratios):.2f}), totals {total['rq']:,}/"
          f"{total['inline']:,} = {overall:.2f}; target >= 0.8: "
          f"{'met' if median >= 0.8 else 'not met'}")
    if a.json:
        Path(a.json).write_text(json.dumps({"runs": runs, "pair_ratios": ratios,
                                            "median_ratio": median, "total_ratio": overall,
                                            "duration_s": a.duration,
                                            "tool_workers": a.tool_workers}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_until_interrupted(main, "tools_rq"))
