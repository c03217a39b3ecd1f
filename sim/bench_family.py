"""`rollout-broker bench --family` and `--sweep`: many scenarios, or one scenario over a parameter.

`--family FILE --samples N --seed S`: draws N scenarios from the family (`sim/family.py`), runs
every policy on each (and `cache_aware_swept`'s grid on each under its sweep seed), and reports
per scenario each policy's throughput as a multiple of the best router baseline of that
scenario, whole run and steady state, and as a share of the scenario's fluid bound; then, per
policy, the minimum and the geometric mean of those ratios over the family.

`--sweep KEY=V1,V2,...` (with `--scenario`): the scenario with one field set to each value in
turn (a dotted path into the scenario, e.g. `trainer.inflight_bound=128,256,512`), every
policy at each, and each policy's throughput against the value.

Every simulation is an independent process task (`--jobs`); scenarios are written as YAML into
a temporary directory so a task is (scenario file, policy) like any bench run.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from broker.policies.cache_aware import cache_aware_grid
from sim.bench import (
    BASELINES,
    CONTENDED_PREEMPTIONS_PER_SESSION,
    ROOM_ABOVE,
    SWEPT,
    RunSpec,
    check_policies,
    headroom,
    result_json,
    run_one,
    sweep_seed,
    write_json,
)
from sim.bound import fluid_bound
from sim.engine.scheduler import check_scheduling_policy
from sim.family import describe, load_family, sample_family
from sim.fleet import FleetResult
from sim.metrics import first_tenth_speed, run_speed, start_up_speed
from sim.scenario import Scenario, load_scenario, parse_scenario
from sim.scenario_checks import scenario_warnings

Task = tuple[str, int | None, RunSpec]


def _run(task: Task) -> FleetResult:
    return run_one(*task)


def run_tasks(tasks: Sequence[Task], jobs: int,
              on_done: Callable[[int], None] | None = None) -> list[FleetResult]:
    """Every (scenario file, seed, spec), in parallel processes when jobs > 1; in order."""
    if jobs <= 1:
        out = []
        for i, t in enumerate(tasks):
            out.append(_run(t))
            if on_done:
                on_done(i)
        return out
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(_run, t) for t in tasks]
        out = []
        for i, f in enumerate(futures):
            out.append(f.result())
            if on_done:
                on_done(i)
        return out


def _write(scenario: Scenario, directory: Path) -> str:
    path = directory / f"{scenario.name}.yaml"
    path.write_text(yaml.safe_dump(scenario.model_dump(mode="json"), sort_keys=False))
    return str(path)


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=False)


def run_scenarios(paths: Sequence[str], policies: Sequence[str], jobs: int, console: Console,
                  warm_start: bool = False
                  ) -> tuple[list[dict[str, FleetResult]], list[dict[str, dict]]]:
    """Every policy on every scenario file: per scenario, results and params by policy (with
    `warm_start`, each policy that learns recalls an earlier run of the scenario first)."""
    params: list[dict[str, dict]] = [{} for _ in paths]
    with _progress(console) as progress:
        if SWEPT in policies:
            grid = cache_aware_grid()
            seeds = [sweep_seed(load_scenario(p).seed) for p in paths]
            tasks = [(p, s, RunSpec("cache_aware", tuple(sorted(g.items()))))
                     for p, s in zip(paths, seeds) for g in grid]
            bar = progress.add_task(f"{SWEPT}: {len(grid)} points × {len(paths)} scenarios, "
                                    "sweep seeds", total=len(tasks))
            swept = run_tasks(tasks, jobs, lambda i: progress.advance(bar))
            for i in range(len(paths)):
                points = swept[i * len(grid):(i + 1) * len(grid)]
                best = max(range(len(grid)), key=lambda j: points[j].metrics.tokens_per_s)
                params[i][SWEPT] = grid[best]
        tasks = []
        for i, p in enumerate(paths):
            for name in policies:
                spec = (RunSpec("cache_aware", tuple(sorted(params[i][SWEPT].items())))
                        if name == SWEPT else RunSpec(name, warm=warm_start))
                params[i].setdefault(name, {})
                tasks.append((p, None, spec))
        bar = progress.add_task(f"{len(policies)} policies × {len(paths)} scenarios",
                                total=len(tasks))
        flat = run_tasks(tasks, jobs, lambda i: progress.advance(bar))
    results = [dict(zip(policies, flat[i * len(policies):(i + 1) * len(policies)]))
               for i in range(len(paths))]
    return results, params


def ratios(results: dict[str, FleetResult], bound: float,
           iterations: int) -> dict[str, dict[str, float | None]]:
    """Per policy: throughput / the best router baseline's (whole run, steady state, cold start:
    each against the best baseline in that phase), throughput / the fluid bound, the headroom
    it took ((policy − best) / (bound − best), None where the bound leaves none), and how fast
    it completed the trainer's first iterations (`metrics.start_up_speed`), the first 10% of
    the run's `iterations` (`metrics.first_tenth_speed`) and all of them (`metrics.run_speed`)
    against the quickest baseline."""
    base = [r.metrics for n, r in results.items() if n in BASELINES]
    best = max((m.tokens_per_s for m in base), default=None)
    best_steady = max((m.steady.tokens_per_s for m in base if m.steady is not None),
                      default=None)
    best_cold = max((m.cold.tokens_per_s for m in base if m.cold is not None), default=None)
    out = {}
    for name, r in results.items():
        m = r.metrics
        out[name] = {
            "x_best": m.tokens_per_s / best if best else None,
            "x_best_steady": (m.steady.tokens_per_s / best_steady
                              if m.steady is not None and best_steady else None),
            "x_best_cold": (m.cold.tokens_per_s / best_cold
                            if m.cold is not None and best_cold else None),
            "start_up_speed": start_up_speed(m, base),
            "first_tenth_speed": first_tenth_speed(m, base, iterations),
            "run_speed": run_speed(m, base, iterations),
            "of_bound": m.tokens_per_s / bound,
            "headroom_taken": ((m.tokens_per_s - best) / (bound - best)
                               if best and bound > best else None),
        }
    return out


def summarize_headroom(rooms: Sequence[dict[str, Any] | None],
                       contended_above: float = CONTENDED_PREEMPTIONS_PER_SESSION
                       ) -> dict[str, Any] | None:
    """The bound's ceiling on ×best over the family: its minimum and geometric mean (the highest
    geometric mean any policy can reach), over every scenario and over the contended ones."""
    known = [h for h in rooms if h is not None and h["bound_x_best"] is not None]
    if not known:
        return None
    contended = [h["bound_x_best"] for h in known
                 if (h["preemptions_per_session"] or 0.0) > contended_above]
    xs = [h["bound_x_best"] for h in known]
    return {"scenarios": len(xs), "min_bound_x_best": min(xs), "geomean_bound_x_best": geomean(xs),
            "contended": len(contended), "contended_above": contended_above,
            "contended_min_bound_x_best": min(contended, default=None),
            "contended_geomean_bound_x_best": geomean(contended) if contended else None}


def summarize_headroom_taken(rows: Sequence[dict[str, dict[str, float | None]]],
                             rooms: Sequence[dict[str, Any] | None], policies: Sequence[str],
                             room_above: float = ROOM_ABOVE) -> dict[str, dict[str, Any]]:
    """Per policy, over the scenarios where the bound leaves room (at least `room_above`× the
    best baseline): the geometric means of its ×best and of the bound's, and the share of the
    geometric-mean headroom it took, log(its) / log(the bound's). Per scenario the share is
    (policy − best) / (bound − best), which a loss makes negative: its geometric mean is
    undefined, the share of the geometric means is not."""
    with_room = [i for i, h in enumerate(rooms)
                 if h is not None and (h["bound_x_best"] or 0.0) >= room_above]
    out: dict[str, dict[str, Any]] = {}
    for name in policies:
        pairs = [(rows[i][name]["x_best"], rooms[i]["bound_x_best"]) for i in with_room
                 if rows[i][name]["x_best"]]
        if not pairs:
            out[name] = {"scenarios": 0, "room_above": room_above}
            continue
        mine, ceiling = geomean([x for x, _ in pairs]), geomean([b for _, b in pairs])
        out[name] = {"scenarios": len(pairs), "room_above": room_above,
                     "geomean_x_best": mine, "geomean_bound_x_best": ceiling,
                     "taken": math.log(mine) / math.log(ceiling)}
    return out


def geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def bench_family(family_path: str, samples: int, seed: int, policies: list[str],
                 json_out: str | None, plots_dir: str | None, jobs: int,
                 console: Console, warm_start: bool = False,
                 scheduling_policy: str | None = None) -> dict[str, Any]:
    """`scheduling_policy`: every drawn scenario's engines run vLLM's `--scheduling-policy`
    (None: the draws' own, `fcfs`)."""
    check_policies(policies)
    spec = load_family(family_path)
    scenarios = sample_family(spec, family_path, samples, seed)
    if scheduling_policy is not None:
        policy = check_scheduling_policy(scheduling_policy)
        scenarios = [s.model_copy(update={"fleet": s.fleet.model_copy(
            update={"scheduling_policy": policy})}) for s in scenarios]
    with tempfile.TemporaryDirectory(prefix="rb-family-") as tmp:
        paths = [_write(s, Path(tmp)) for s in scenarios]
        bounds = [fluid_bound(s, p) for s, p in zip(scenarios, paths)]
        warnings = [scenario_warnings(s, p) for s, p in zip(scenarios, paths)]
        results, params = run_scenarios(paths, policies, jobs, console, warm_start)
    rows = [ratios(r, b.tokens_per_s, s.trainer.iterations)
            for r, b, s in zip(results, bounds, scenarios)]
    rooms = [headroom(r, b.tokens_per_s) for r, b in zip(results, bounds)]
    report = {
        "family": spec.name, "family_file": family_path, "samples": samples, "seed": seed,
        "warm_start": warm_start, "scheduling_policy": scheduling_policy or "fcfs",
        "scenarios": [{
            "name": s.name, "describe": describe(s), "parameters": s.model_dump(mode="json"),
            "bound": asdict(b), "headroom": room, "scenario_warnings": w, "ratios": row,
            "policies": {n: result_json(res[n], params_i[n]) for n in policies},
        } for s, b, room, w, row, res, params_i in zip(scenarios, bounds, rooms, warnings, rows,
                                                        results, params)],
        "summary": summarize_family(rows, policies),
        "headroom": summarize_headroom(rooms),
        "headroom_taken": summarize_headroom_taken(rows, rooms, policies),
    }
    print_family(console, report, policies)
    if json_out:
        write_json(json_out, report)
        console.print(f"wrote {json_out}")
    if plots_dir:
        for p in plot_family(report, policies, plots_dir):
            console.print(f"wrote {p}")
    return report


def summarize_family(rows: Sequence[dict[str, dict[str, float | None]]],
                     policies: Sequence[str]) -> dict[str, dict[str, float | int | None]]:
    """Per policy: the minimum and geometric mean of each ratio over the scenarios that have it,
    the wins (whole run above the best baseline) and the mean share of the bound."""
    out = {}
    for name in policies:
        summary: dict[str, float | int | None] = {}
        present: dict[str, list[float]] = {}
        for key in ("x_best", "x_best_steady", "x_best_cold", "start_up_speed",
                    "first_tenth_speed", "run_speed"):
            xs = present[key] = [r[name][key] for r in rows if r[name][key]]
            summary[f"min_{key}"] = min(xs, default=None)
            summary[f"geomean_{key}"] = geomean(xs) if xs else None
        whole = present["x_best"]
        bound = [r[name]["of_bound"] for r in rows]
        summary["wins"] = sum(1 for x in whole if x > 1.0)
        summary["scenarios"] = len(whole)
        summary["mean_of_bound"] = sum(bound) / len(bound) if bound else None
        out[name] = summary
    return out


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _taken(h: dict[str, Any]) -> str:
    if not h["scenarios"]:
        return "-"
    return f"{100 * h['taken']:.0f}% of {h['geomean_bound_x_best']:.2f}× ({h['scenarios']})"


def print_family(console: Console, report: dict[str, Any], policies: Sequence[str]) -> None:
    t = Table(title=f"{report['family']}: {report['samples']} scenarios (seed {report['seed']}), "
                    "throughput × the best router baseline (whole run / steady state)")
    t.add_column("scenario", no_wrap=True)
    for n in policies:
        t.add_column(n, justify="right")
    for sc in report["scenarios"]:
        cells = [f"{_f(sc['ratios'][n]['x_best'])}/{_f(sc['ratios'][n]['x_best_steady'])}"
                 for n in policies]
        t.add_row(sc["name"], *cells)
    console.print(t)
    s = Table(title="over the family (start-up, first 10%, run pace: the speed of the trainer's "
                    "first iterations, of its first 10% and of all of them against the quickest "
                    "baseline)")
    for col in ("policy", "min ×best", "geomean ×best", "min ×best steady",
                "geomean ×best steady", "min ×best cold", "geomean ×best cold", "min start-up",
                "geomean start-up", "min first 10%", "geomean first 10%", "min run pace",
                "geomean run pace", "wins",
                "mean % of bound", "headroom taken"):
        s.add_column(col, justify="left" if col == "policy" else "right", no_wrap=col == "policy")
    for n in policies:
        m = report["summary"][n]
        s.add_row(n, _f(m["min_x_best"]), _f(m["geomean_x_best"]), _f(m["min_x_best_steady"]),
                  _f(m["geomean_x_best_steady"]), _f(m["min_x_best_cold"]),
                  _f(m["geomean_x_best_cold"]), _f(m["min_start_up_speed"]),
                  _f(m["geomean_start_up_speed"]), _f(m["min_first_tenth_speed"]),
                  _f(m["geomean_first_tenth_speed"]), _f(m["min_run_speed"]),
                  _f(m["geomean_run_speed"]), f"{m['wins']}/{m['scenarios']}",
                  _f(100 * m["mean_of_bound"] if m["mean_of_bound"] is not None else None, ".0f"),
                  _taken(report["headroom_taken"][n]))
    console.print(s)
    for sc in report["scenarios"]:
        room = sc["headroom"]
        ceiling = f" ({_f(room['bound_x_best'])}× the best baseline)" if room else ""
        console.print(f"{sc['name']}: {sc['describe']}; bound {sc['bound']['tokens_per_s']:,.0f} "
                      f"tok/s{ceiling}")
    h = report["headroom"]
    if h:
        console.print(
            f"the fluid bound allows at most {_f(h['min_bound_x_best'])}× the best baseline on the "
            f"tightest scenario and a geometric mean of {_f(h['geomean_bound_x_best'])}×; on the "
            f"{h['contended']} contended scenarios (best baseline preempting more than "
            f"{h['contended_above']:g} per finished session) at most "
            f"{_f(h['contended_min_bound_x_best'])}× on the tightest")
    console.print(f"headroom taken: over the scenarios whose bound is at least {ROOM_ABOVE:g}× the "
                  "best baseline, log(geomean ×best) ÷ log(geomean bound ×best); per scenario "
                  "(policy − best) ÷ (bound − best) is in the JSON report")


def plot_family(report: dict[str, Any], policies: Sequence[str], out_dir: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(policies)), 4.5))
    for i, n in enumerate(policies):
        ys = [sc["ratios"][n]["x_best"] for sc in report["scenarios"] if sc["ratios"][n]["x_best"]]
        ax.scatter([i + (j % 7 - 3) * 0.04 for j in range(len(ys))], ys, s=12, alpha=0.7)
        if ys:
            ax.hlines(geomean(ys), i - 0.3, i + 0.3, color="black", linewidth=1.5)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(policies)), policies, rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="tok/s ÷ best router baseline", title=f"{report['family']}: "
           f"{report['samples']} scenarios (bar: geometric mean)")
    fig.tight_layout()
    path = out / "family.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


# -- one scenario over a parameter ----------------------------------------------------------

def parse_sweep(text: str) -> tuple[str, list[Any]]:
    key, sep, values = text.partition("=")
    if not sep or not key or not values:
        raise ValueError(f"sweep: {text!r} must be KEY=V1,V2,... (e.g. trainer.inflight_bound=128,256)")
    return key, [yaml.safe_load(v) for v in values.split(",") if v.strip()]


def with_field(scenario: Scenario, key: str, value: Any) -> Scenario:
    data = scenario.model_dump(mode="python")
    node = data
    parts = key.split(".")
    for p in parts[:-1]:
        if not isinstance(node, dict) or p not in node:
            raise ValueError(f"sweep: {key!r}: no field {p!r} in the scenario")
        node = node[p]
    if not isinstance(node, dict) or parts[-1] not in node:
        raise ValueError(f"sweep: {key!r}: no field {parts[-1]!r} in the scenario")
    node[parts[-1]] = value
    data["name"] = f"{scenario.name}-{parts[-1]}-{value}"
    return parse_scenario(data, origin=f"sweep {key}={value}")


def bench_sweep(scenario_path: str, sweep: str, policies: list[str], json_out: str | None,
                plots_dir: str | None, jobs: int, console: Console) -> dict[str, Any]:
    check_policies(policies)
    key, values = parse_sweep(sweep)
    base = load_scenario(scenario_path)
    scenarios = [with_field(base, key, v) for v in values]
    with tempfile.TemporaryDirectory(prefix="rb-sweep-") as tmp:
        paths = [_write(s, Path(tmp)) for s in scenarios]
        bounds = [fluid_bound(s, p) for s, p in zip(scenarios, paths)]
        results, params = run_scenarios(paths, policies, jobs, console)
    report = {
        "scenario": base.name, "scenario_file": scenario_path, "key": key, "values": values,
        "points": [{"value": v, "bound": asdict(b), "headroom": headroom(r, b.tokens_per_s),
                    "ratios": ratios(r, b.tokens_per_s, s.trainer.iterations),
                    "policies": {n: result_json(r[n], p[n]) for n in policies}}
                   for v, b, r, p, s in zip(values, bounds, results, params, scenarios)],
    }
    t = Table(title=f"{base.name}: tok/s (steady) against {key}")
    t.add_column(key, justify="right")
    for n in policies:
        t.add_column(n, justify="right")
    t.add_column("bound", justify="right")
    t.add_column("bound ÷ best baseline", justify="right")
    for pt in report["points"]:
        cells = []
        for n in policies:
            m = pt["policies"][n]["metrics"]
            st = m["steady"]["tokens_per_s"] if m.get("steady") else None
            cells.append(f"{m['tokens_per_s']:,.0f} ({_f(st, ',.0f')})")
        room = pt["headroom"]
        t.add_row(str(pt["value"]), *cells, f"{pt['bound']['tokens_per_s']:,.0f}",
                  _f(room["bound_x_best"] if room else None))
    console.print(t)
    if json_out:
        write_json(json_out, report)
        console.print(f"wrote {json_out}")
    if plots_dir:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        out = Path(plots_dir)
        out.mkdir(parents=True, exist_ok=True)
        fig, ax = plt.subplots(figsize=(8, 4.5))
        xs = list(range(len(values)))
        for n in policies:
            ax.plot(xs, [pt["policies"][n]["metrics"]["tokens_per_s"] for pt in report["points"]],
                    marker="o", label=n, linewidth=1.2)
        ax.plot(xs, [pt["bound"]["tokens_per_s"] for pt in report["points"]], color="black",
                linestyle="--", label="fluid bound")
        ax.set_xticks(xs, [str(v) for v in values])
        ax.set(xlabel=key, ylabel="generated tokens/s", title=f"{base.name}: throughput vs {key}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / "sweep.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        console.print(f"wrote {path}")
    return report
