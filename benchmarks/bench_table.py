"""Markdown tables from `rollout-broker bench --json` files (how docs/misa-t.md §3a is made).

    python benchmarks/bench_table.py OUT.json [OUT2.json ...]

One table per file: every policy in the file, its throughput as a multiple of the best router
baseline in the same run, and the DESIGN §6 metrics.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sim.bench import BASELINES, ORACLE, SWEPT

ORDER = ("round_robin", "least_loaded", "power_of_two", "cache_aware", SWEPT, "misa_t",
         "misa_t-admission", "misa_t-allocation", "misa_t-residency", "misa_t-paced", ORACLE)


def label(name: str, entry: dict) -> str:
    if name == SWEPT and entry.get("params"):
        p = entry["params"]
        return (f"{name} ({p['cache_threshold']}/{p['balance_abs_threshold']}/"
                f"{p['balance_rel_threshold']})")
    return name + (" (upper ref.)" if name == ORACLE else "")


def table(report: dict) -> str:
    policies = report["policies"]
    names = [n for n in ORDER if n in policies] + [n for n in policies if n not in ORDER]
    base = [policies[n]["metrics"]["tokens_per_s"] for n in names if n in BASELINES]
    best = max(base) if base else None
    lines = [f"**{report['scenario']}** (seed {report['seed']})", "",
             "| policy | tok/s | ×best baseline | iter s | drift | prefix hit | preemptions "
             "| KV util | p99 s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n in names:
        e = policies[n]
        m = e["metrics"]
        ratio = f"{m['tokens_per_s'] / best:.2f}" if best else "-"
        cut = "" if e["completed"] else " (cut)"
        lines.append(
            f"| {label(n, e)}{cut} | {m['tokens_per_s']:,.0f} | {ratio} | "
            f"{m['mean_iteration_s']:.1f} | {m['mean_drift']:.3f} | {m['prefix_hit_rate']:.3f} | "
            f"{m['preemptions']:,} | {m['kv_utilisation']:.2f} | {m['latency_p99_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", type=Path)
    args = ap.parse_args()
    print("\n\n".join(table(json.loads(p.read_text())) for p in args.reports))


if __name__ == "__main__":
    main()
