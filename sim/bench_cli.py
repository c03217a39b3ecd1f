"""The `rollout-broker bench` command: progress while it runs, a table, JSON and plots."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from broker.policies.cache_aware import cache_aware_grid
from sim.bench import (
    BASELINES,
    SWEPT,
    RunSpec,
    check_policies,
    headroom,
    result_json,
    run_many,
    run_one,
    sweep_cache_aware,
    sweep_seed,
    with_overrides,
    write_json,
)
from sim.bound import FluidBound, fluid_bound
from sim.fleet import FleetResult
from sim.metrics import run_speed, start_up_speed
from sim.scenario import load_scenario
from sim.scenario_checks import scenario_warnings


def bench(scenario_path: str, policies: list[str], seed: int | None, json_out: str | None,
          plots_dir: str | None, jobs: int, sweep_iterations: int | None,
          console: Console | None = None, warm_start: bool = False) -> dict[str, Any]:
    if console is None:
        console = Console(stderr=True)
        if not console.is_terminal:
            console = Console(stderr=True, width=230)
    scenario = with_overrides(load_scenario(scenario_path), seed, None)  # validates early
    check_policies(policies)
    for w in scenario_warnings(scenario, scenario_path):
        console.print(f"[yellow]warning:[/] {scenario.name}: {w}")
    bound = fluid_bound(scenario, scenario_path)
    tune_seed = sweep_seed(scenario.seed)
    results: dict[str, FleetResult] = {}
    params: dict[str, dict[str, Any]] = {}
    walls: dict[str, float] = {}
    sweep_points: list[dict[str, Any]] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        if SWEPT in policies:
            length = f"{sweep_iterations} iterations" if sweep_iterations else "full runs"
            grid_task = progress.add_task(f"{SWEPT}: sweep on seed {tune_seed} ({length})",
                                          total=len(cache_aware_grid()))
            best, sweep_points = sweep_cache_aware(
                scenario_path, tune_seed, sweep_iterations, jobs,
                on_done=lambda spec, res: progress.advance(grid_task))
            params[SWEPT] = best
        specs = []
        for name in policies:
            if name == SWEPT:
                specs.append(RunSpec("cache_aware", tuple(sorted(params[SWEPT].items()))))
            else:
                specs.append(RunSpec(name, warm=warm_start))
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

    room = headroom(results, bound.tokens_per_s)
    report = {
        "scenario": scenario.name,
        "scenario_file": str(scenario_path),
        "seed": scenario.seed,
        "warm_start": warm_start,
        "parameters": scenario.model_dump(mode="json"),
        "bound": asdict(bound),
        "headroom": room,
        "scenario_warnings": scenario_warnings(scenario, scenario_path),
        "policies": {n: result_json(results[n], params[n]) for n in policies},
    }
    if sweep_points:
        report["cache_aware_sweep"] = {"seed": tune_seed, "iterations": sweep_iterations,
                                       "points": sweep_points}
    print_table(console, scenario.name, results, params, walls, bound, room)
    if json_out:
        write_json(json_out, report)
        console.print(f"wrote {json_out}")
    if plots_dir:
        from sim.plots import write_plots

        for p in write_plots(results, plots_dir, scenario.name):
            console.print(f"wrote {p}")
    return report


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def print_table(console: Console, scenario: str, results: dict[str, FleetResult],
                params: dict[str, dict[str, Any]], walls: dict[str, float],
                bound: FluidBound | None = None, room: dict[str, Any] | None = None) -> None:
    """Whole run, cold start and steady state apart; ratios to the best router baseline of
    the same run (overall and steady), and to the fluid bound. `room`: the bound's headroom
    (`sim.bench.headroom`), printed under the bound."""
    base = [results[n].metrics for n in results if n in BASELINES]
    best = max((m.tokens_per_s for m in base), default=None)
    best_steady = max((m.steady.tokens_per_s for m in base if m.steady is not None), default=None)
    t = Table(title=f"{scenario}: rollout policies (same sessions, same seed)")
    iterations = max((len(r.metrics.iteration_done_s) for r in results.values()), default=0)
    for col in ("policy", "tok/s", "×best base", "% bound", "cold tok/s", "start-up", "run pace",
                "steady tok/s", "×best steady", "steady iter s", "drift steady", "drift start", "drift cum",
                "prefix hit", "preempt cold/steady", "KV util", "p99 s", "done", "wall s"):
        t.add_column(col, justify="left" if col == "policy" else "right", no_wrap=col == "policy")
    for name, r in results.items():
        m = r.metrics
        label = name
        if name == SWEPT and params.get(name):
            p = params[name]
            label += f" [{p['cache_threshold']}/{p['balance_abs_threshold']}/{p['balance_rel_threshold']}]"
        steady = m.steady
        ratio = f"{m.tokens_per_s / best:.2f}" if best else "-"
        ratio_steady = (f"{steady.tokens_per_s / best_steady:.2f}"
                        if steady is not None and best_steady else "-")
        pct = f"{100 * m.tokens_per_s / bound.tokens_per_s:.0f}%" if bound else "-"
        preempt = f"{m.cold.preemptions:,}/{steady.preemptions:,}" if steady else f"{m.preemptions:,}/-"
        t.add_row(label, f"{m.tokens_per_s:,.0f}", ratio, pct,
                  f"{m.cold.tokens_per_s:,.0f}", _f(start_up_speed(m, base), ".2f"),
                  _f(run_speed(m, base, iterations) if iterations else None, ".2f"),
                  _f(steady.tokens_per_s if steady else None, ",.0f"), ratio_steady,
                  _f(steady.mean_iteration_s if steady else None, ".1f"),
                  _f(m.drift.steady, ".3f"), _f(m.drift.startup, ".3f"),
                  f"{m.drift.cumulative:.3f}", f"{m.prefix_hit_rate:.3f}", preempt,
                  f"{m.kv_utilisation:.2f}", f"{m.latency_p99_s:.0f}",
                  "yes" if r.completed else "CUT", f"{walls.get(name, 0):.0f}")
    console.print(t)
    console.print("start-up, run pace: how fast the trainer's first iterations, and all of them, "
                  "completed against the quickest baseline (above 1: sooner; "
                  "docs/measurement.md)")
    print_weight_updates(console, results)
    print_scale_changes(console, results)
    print_lora(console, results)
    any_result = next(iter(results.values()), None)
    if bound is not None:
        barrier = (f", the sync steps' slowest sessions {100 * bound.barrier_share:.0f}% of "
                   "the time" if bound.barrier_share else "")
        console.print(f"fluid bound {bound.tokens_per_s:,.0f} tok/s: {bound.seqs_per_engine:.1f} "
                      f"sequences per engine (limited by {bound.limited_by}), mean context "
                      f"{bound.mean_context:,.0f} tokens ({bound.mean_kv_context:,.0f} in KV "
                      f"with shared prompt blocks held once), {bound.prefill_per_output:.2f} prefill "
                      f"tokens and {1000 * bound.outside_per_output:.1f} ms off the engine per "
                      f"output token, {100 * bound.waits_kept:.0f}% of tool waits kept in KV"
                      f"{barrier} (sim/bound.py)")
        if room is not None and room["bound_x_best"] is not None:
            best = room["best_tokens_per_s"]
            console.print(f"no policy can exceed {room['bound_x_best']:.2f}× the best baseline "
                          f"({room['best_baseline']}, {best:,.0f} tok/s) here")
            if bound.tokens_per_s > best:
                taken = ", ".join(
                    f"{n} {100 * (r.metrics.tokens_per_s - best) / (bound.tokens_per_s - best):.0f}%"
                    for n, r in results.items() if n not in BASELINES)
                if taken:
                    console.print(f"headroom taken, (policy − best) ÷ (bound − best): {taken}")
    if any_result is not None:
        console.print(f"drift floor at this batch size (independent draws of π): "
                      f"{any_result.metrics.drift.floor:.3f}")
    for name, r in results.items():
        for w in r.metrics.warnings:
            console.print(f"[yellow]warning:[/] {name}: {w}")


def print_weight_updates(console: Console, results: dict[str, FleetResult]) -> None:
    """What the scenario's weight updates cost each policy (nothing when it has none)."""
    rows = {n: r.metrics.weight_updates for n, r in results.items()
            if r.metrics.weight_updates is not None}
    if not rows:
        return
    t = Table(title="weight updates (pause → every engine paused → load → resume)")
    for col in ("policy", "updates", "paused s / update", "drain s / update", "tokens kept",
                "tokens thrown away", "re-prefill tokens"):
        t.add_column(col, justify="left" if col == "policy" else "right", no_wrap=col == "policy")
    for name, wu in rows.items():
        n = max(wu.updates, 1)
        t.add_row(name, f"{wu.updates:,}", f"{wu.paused_s / n:.2f}", f"{wu.drain_s / n:.2f}",
                  f"{wu.tokens_kept:,}", f"{wu.tokens_thrown_away:,}", f"{wu.reprefill_tokens:,}")
    console.print(t)


def print_scale_changes(console: Console, results: dict[str, FleetResult]) -> None:
    """What engines joining and leaving (`fleet.changes`) did under each policy (nothing when
    the fleet is fixed). Lost tokens are output generated twice because an engine left: 0
    when every hand-back keeps its partial output."""
    rows = {n: r for n, r in results.items() if r.metrics.scale is not None}
    if not rows:
        return
    t = Table(title="fleet changes (engines joining; leaving through the drain)")
    for col in ("policy", "joined", "left", "sessions delivered", "duplicates", "handed back",
                "tokens handed back", "tokens lost", "re-prefill tokens"):
        t.add_column(col, justify="left" if col == "policy" else "right", no_wrap=col == "policy")
    for name, r in rows.items():
        sc = r.metrics.scale
        ids = [s.session_id for s in r.sessions]
        t.add_row(name, f"{sc.engines_joined:,}", f"{sc.engines_left:,}", f"{len(ids):,}",
                  f"{len(ids) - len(set(ids)):,}", f"{sc.sessions_handed_back:,}",
                  f"{sc.tokens_handed_back:,}", f"{sc.tokens_lost_to_scale_in:,}",
                  f"{sc.reprefill_tokens:,}")
    console.print(t)


def print_lora(console: Console, results: dict[str, FleetResult]) -> None:
    """What LoRA adapters cost each policy (nothing when the engines run without LoRA)."""
    rows = {n: r for n, r in results.items() if r.metrics.lora is not None}
    if not rows:
        return
    t = Table(title="LoRA adapters (loads on the engines; turns that waited for a slot)")
    for col in ("policy", "adapter loads", "slot waits", "slot wait s (summed)"):
        t.add_column(col, justify="left" if col == "policy" else "right", no_wrap=col == "policy")
    for name, r in rows.items():
        lo = r.metrics.lora
        t.add_row(name, f"{lo.loads:,}", f"{lo.slot_waits:,}", f"{lo.slot_wait_s:,.0f}")
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
