"""Markdown tables from `rollout-broker bench --json` files (how the tables of
docs/results/misa-t.md §1b are made).

    python benchmarks/bench_table.py OUT.json [OUT2.json ...]

One table per file: every policy in the file, its throughput as a multiple of the best router
baseline in the same run (whole run and steady state) and as a share of the fluid bound, and
the run metrics with the cold start and the steady state apart.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sim.bench import BASELINES, SWEPT, TRUE_LENGTHS

ORDER = ("round_robin", "least_loaded", "power_of_two", "cache_aware", SWEPT, "misa_t",
         "misa_t-admission", "misa_t-allocation", "misa_t-residency", "misa_t-paced",
         TRUE_LENGTHS)


def label(name: str, entry: dict) -> str:
    if name == SWEPT and entry.get("params"):
        p = entry["params"]
        return (f"{name} ({p['cache_threshold']}/{p['balance_abs_threshold']}/"
                f"{p['balance_rel_threshold']})")
    return name


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(report: dict) -> str:
    policies = report["policies"]
    names = [n for n in ORDER if n in policies] + [n for n in policies if n not in ORDER]
    base = [policies[n]["metrics"] for n in names if n in BASELINES]
    best = max((m["tokens_per_s"] for m in base), default=None)
    best_steady = max((m["steady"]["tokens_per_s"] for m in base if m.get("steady")),
                      default=None)
    bound = report.get("bound", {}).get("tokens_per_s")
    lines = [f"**{report['scenario']}** (seed {report['seed']})", "",
             "| policy | tok/s | ×best baseline | % of bound | cold tok/s | steady tok/s | "
             "×best steady | steady iter s | drift steady / start-up / cumulative | "
             "prefix hit | preemptions cold / steady | KV util | p99 s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in names:
        e = policies[n]
        m = e["metrics"]
        st, d = m.get("steady"), m["drift"]
        ratio = f"{m['tokens_per_s'] / best:.2f}" if best else "-"
        ratio_st = f"{st['tokens_per_s'] / best_steady:.2f}" if st and best_steady else "-"
        pct = f"{100 * m['tokens_per_s'] / bound:.0f}%" if bound else "-"
        cut = "" if e["completed"] else " (cut)"
        lines.append(
            f"| {label(n, e)}{cut} | {m['tokens_per_s']:,.0f} | {ratio} | {pct} | "
            f"{m['cold']['tokens_per_s']:,.0f} | {_f(st and st['tokens_per_s'], ',.0f')} | "
            f"{ratio_st} | {_f(st and st['mean_iteration_s'], '.1f')} | "
            f"{_f(d['steady'], '.3f')} / {_f(d['startup'], '.3f')} / {d['cumulative']:.3f} | "
            f"{m['prefix_hit_rate']:.3f} | {m['cold']['preemptions']:,} / "
            f"{_f(st and st['preemptions'], ',')} | {m['kv_utilisation']:.2f} | "
            f"{m['latency_p99_s']:.0f} |")
    if bound:
        b = report["bound"]
        lines += ["", f"Fluid bound {bound:,.0f} tok/s ({b['seqs_per_engine']:.0f} sequences per "
                      f"engine, limited by {b['limited_by']}); drift floor "
                      f"{policies[names[0]]['metrics']['drift']['floor']:.3f}."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", type=Path)
    args = ap.parse_args()
    print("\n\n".join(table(json.loads(p.read_text())) for p in args.reports))


if __name__ == "__main__":
    main()
