"""PNG plots of a bench run: throughput over time, KV usage per engine, drift per iteration."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from sim.fleet import FleetResult


def _bucketed_throughput(result: FleetResult, bucket_s: float) -> tuple[list[float], list[float]]:
    end = result.sim_time_s
    n = max(1, int(end // bucket_s) + 1)
    tokens = [0.0] * n
    for s in result.sessions:
        tokens[min(n - 1, int(s.finished_at // bucket_s))] += s.output_tokens
    return [(i + 0.5) * bucket_s for i in range(n)], [t / bucket_s for t in tokens]


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(results: Mapping[str, FleetResult], out_dir: str | Path, scenario_name: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    span = max(r.sim_time_s for r in results.values())
    bucket = max(10.0, span / 60)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, r in results.items():
        x, y = _bucketed_throughput(r, bucket)
        ax.plot(x, y, label=name, linewidth=1.2)
    ax.set(xlabel="simulated time (s)", ylabel="generated tokens/s (finished sessions)",
           title=f"{scenario_name}: rollout throughput over time ({bucket:.0f} s buckets)")
    ax.legend(fontsize=8)
    paths.append(_save(plt, fig, out / "throughput.png"))

    n = len(results)
    cols = min(3, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False, sharey=True)
    for ax, (name, r) in zip(axes.flat, results.items()):
        by_engine: dict[str, list[tuple[float, float]]] = {}
        for s in r.kv_samples:
            by_engine.setdefault(s.engine_id, []).append((s.at, s.usage))
        for eid, pts in by_engine.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], linewidth=0.7, label=eid)
        ax.set(title=name, xlabel="simulated time (s)", ylabel="KV usage", ylim=(0, 1.02))
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(f"{scenario_name}: KV cache usage per engine")
    paths.append(_save(plt, fig, out / "kv_usage.png"))

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, r in results.items():
        d = r.metrics.drift_per_iteration
        ax.plot(range(1, len(d) + 1), d, marker=".", label=name, linewidth=1)
    ax.set(xlabel="iteration", ylabel="mixture drift ½·Σ|consumed − π|",
           title=f"{scenario_name}: mixture drift per iteration")
    ax.legend(fontsize=8)
    paths.append(_save(plt, fig, out / "drift.png"))
    return paths
