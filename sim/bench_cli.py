"""The `rollout-broker bench` command: progress while it runs, a table, JSON and plots."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from broker.policies.cache_aware import cache_aware_grid
from sim.bench import (
    BASELINES,
    ORACLE,
    SWEPT,
    RunSpec,
    check_policies,
    result_json,
    run_many,
    run_one,
    sweep_cache_aware,
    with_overrides,
    write_json,
)
from sim.fleet import FleetResult
from sim.scenario import load_scenario


def bench(scenario_path: str, policies: list[str], seed: int | None, json_out: str | None,
          plots_dir: str | None, jobs: int, sweep_iterations: int | None,
          console: Console | None = None) -> dict[str, Any]:
    if console is None:
        console = Console(stderr=True)
        if not console.is_terminal:
            console = Console(stderr=True, width=170)
    scenario = with_overrides(load_scenario(scenario_path), seed, None)  # validates early
    check_policies(policies)
    sweep_its = sweep_iterations or max(2, min(5, scenario.trainer.iterations // 10))
    results: dict[str, FleetResult] = {}
    params: dict[str, dict[str, Any]] = {}
    walls: dict[str, float] = {}
    sweep_points: list[dict[str, Any]] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        if SWEPT in policies:
            grid_task = progress.add_task(f"{SWEPT}: sweep ({sweep_its} iterations each)", total=len(cache_aware_grid()))
            best, sweep_points = sweep_cache_aware(
                scenario_path, seed, sweep_its, jobs,
                on_done=lambda spec, res: progress.advance(grid_task))
            params[SWEPT] = best
        specs = []
        for name in policies:
            if name == SWEPT:
                specs.append(RunSpec("cache_aware", tuple(sorted(params[SWEPT].items()))))
            else:
                specs.append(RunSpec(name))
                params[name] = {}
        tasks = {name: progress.add_task(name, total=scenario.trainer.iterations) for name in policies}
        if jobs <= 1:
            for name, spec in zip(policies, specs):
                t0 = time.monotonic()
                results[name] = run_one(scenario_path, seed, spec,
                                        on_iteration=lambda i, n=name: progress.update(tasks[n], completed=i))
                walls[name] = time.monotonic() - t0
        else:
            t0 = time.monotonic()
            names = iter(policies)

            def done(spec: RunSpec, res: FleetResult) -> None:
                name = next(names)
                progress.update(tasks[name], completed=len(res.iterations))
                walls[name] = time.monotonic() - t0

            for name, res in zip(policies, run_many(scenario_path, seed, specs, jobs, done)):
                results[name] = res

    report = {
        "scenario": scenario.name,
        "scenario_file": str(scenario_path),
        "seed": scenario.seed,
        "parameters": scenario.model_dump(mode="json"),
        "policies": {n: result_json(results[n], params[n]) for n in policies},
    }
    if sweep_points:
        report["cache_aware_sweep"] = {"iterations": sweep_its, "points": sweep_points}
    print_table(console, scenario.name, results, params, walls)
    if json_out:
        write_json(json_out, report)
        console.print(f"wrote {json_out}")
    if plots_dir:
        from sim.plots import write_plots

        for p in write_plots(results, plots_dir, scenario.name):
            console.print(f"wrote {p}")
    return report


def print_table(console: Console, scenario: str, results: dict[str, FleetResult],
                params: dict[str, dict[str, Any]], walls: dict[str, float]) -> None:
    base = [results[n].metrics.tokens_per_s for n in results if n in BASELINES]
    best_base = max(base) if base else None
    t = Table(title=f"{scenario}: rollout policies (same sessions, same seed)")
    for col in ("policy", "tok/s", "×best base", "sess/s", "iter s", "drift", "prefix hit",
                "preempt", "KV util", "p50 s", "p99 s", "done", "wall s"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for name, r in results.items():
        m = r.metrics
        label = name + (" (upper ref.)" if name == ORACLE else "")
        if name == SWEPT and params.get(name):
            p = params[name]
            label += f" [{p['cache_threshold']}/{p['balance_abs_threshold']}/{p['balance_rel_threshold']}]"
        ratio = f"{m.tokens_per_s / best_base:.2f}" if best_base else "-"
        t.add_row(label, f"{m.tokens_per_s:,.0f}", ratio, f"{m.sessions_per_s:.2f}",
                  f"{m.mean_iteration_s:.1f}", f"{m.mean_drift:.3f}", f"{m.prefix_hit_rate:.3f}",
                  f"{m.preemptions:,}", f"{m.kv_utilisation:.2f}", f"{m.latency_p50_s:.0f}",
                  f"{m.latency_p99_s:.0f}", "yes" if r.completed else "CUT",
                  f"{walls.get(name, 0):.0f}")
    console.print(t)


def parse_policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise ValueError("policies: give at least one policy name")
    if len(set(names)) != len(names):
        raise ValueError("policies: a policy is listed twice")
    return names


def default_json_path(scenario_path: str) -> Path:
    return Path(f"bench-{Path(scenario_path).stem}.json")
