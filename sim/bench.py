"""`rollout-broker bench`: every policy on one scenario, same seed, side by side (docs/measurement.md).

Each policy runs in its own `FleetSim` over the same generated (or replayed) sessions. Two
names are built here rather than in the registry, because they need the simulator:
- `cache_aware_swept` — the paper's sweep-tuned vLLM Router: `cache_aware` over the parameter
  grid of `cache_aware_grid()` (the router's defaults among its points), each point run on the
  whole scenario under a *different seed* (`sweep_seed`: the evaluation seed + 1), and the best
  point by rollout throughput is then run on the evaluation seed: tuned, but not on the run it
  is judged on, nor on its start-up alone;
- `misa_t-true-lengths` — MISA-T fed the simulator's true output lengths: a reference for
  MISA-T's machinery, never a deployable policy and not an upper bound (see `sim/bound.py`).
The JSON holds only simulated quantities, so the same scenario and seed give the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from broker.completions import RECALL_COMPLETIONS
from broker.policies import make_policy, policy_names
from broker.policies.base import Policy
from sim.fleet import FleetResult, FleetSim
from sim.scenario import Scenario, load_scenario, parse_scenario
from sim.workloads.source import make_source

SWEPT = "cache_aware_swept"
TRUE_LENGTHS = "misa_t-true-lengths"
BASELINES = ("round_robin", "least_loaded", "power_of_two", "cache_aware", SWEPT)
# A scenario is contended when its best router baseline preempts more than this per finished
# session (docs/measurement.md).
CONTENDED_PREEMPTIONS_PER_SESSION = 0.01
# A scenario leaves room for a policy to beat the routers when its fluid bound is at least this
# many times the best baseline's throughput; the headroom a policy takes is summarised over those.
ROOM_ABOVE = 1.2


@dataclass(frozen=True)
class RunSpec:
    """One simulation: a policy name with its parameters on a (possibly shortened) scenario."""

    policy: str
    params: tuple[tuple[str, Any], ...] = ()
    iterations: int | None = None  # override the scenario's (sweeps run short)
    # Start from an earlier run of the same job (`earlier_run_seed`): the policy recalls its
    # completions first, as a broker recalls the namespace's from Redis.
    warm: bool = False


def known_policies() -> list[str]:
    return sorted({*policy_names(), SWEPT})


def check_policies(names: Sequence[str]) -> None:
    known = known_policies()
    for n in names:
        if n not in known:
            raise ValueError(f"policies: unknown policy {n!r}; known: {', '.join(known)}")


def with_overrides(scenario: Scenario, seed: int | None, iterations: int | None) -> Scenario:
    data = scenario.model_dump(mode="python")
    if seed is not None:
        data["seed"] = seed
    if iterations is not None:
        data["trainer"]["iterations"] = iterations
    return parse_scenario(data, origin=scenario.name)


def run_one(scenario_path: str, seed: int | None, spec: RunSpec,
            on_iteration: Callable[[int], None] | None = None) -> FleetResult:
    """Simulate one policy on the scenario (in this process)."""
    scenario = with_overrides(load_scenario(scenario_path), seed, spec.iterations)
    source = make_source(scenario, scenario_path)
    sim = FleetSim(scenario, None, source,
                   on_iteration=(lambda it: on_iteration(it.index + 1)) if on_iteration else None)
    params = dict(spec.params)
    if spec.policy == TRUE_LENGTHS:
        params["true_output_lengths"] = sim.true_output_lengths
    sim.policy = make_policy(spec.policy, **params)
    if spec.warm and type(sim.policy).recall is not Policy.recall:
        earlier = run_one(scenario_path, earlier_run_seed(scenario.seed), replace(spec, warm=False))
        sim.policy.recall(earlier.completions[-RECALL_COMPLETIONS:])
    return sim.run()


def earlier_run_seed(scenario_seed: int) -> int:
    """The seed of the earlier run a warm start recalls: neither the evaluated one nor the
    swept router's (`sweep_seed`)."""
    return scenario_seed - 1


def _run_in_worker(args: tuple[str, int | None, RunSpec]) -> FleetResult:
    return run_one(*args)


def run_many(scenario_path: str, seed: int | None, specs: Sequence[RunSpec], jobs: int,
             on_done: Callable[[RunSpec, FleetResult], None] | None = None) -> list[FleetResult]:
    """Run the specs, in parallel processes when jobs > 1; results in the order given."""
    if jobs <= 1:
        out = []
        for spec in specs:
            res = run_one(scenario_path, seed, spec)
            if on_done:
                on_done(spec, res)
            out.append(res)
        return out
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(_run_in_worker, (scenario_path, seed, s)) for s in specs]
        out = []
        for spec, fut in zip(specs, futures):
            res = fut.result()
            if on_done:
                on_done(spec, res)
            out.append(res)
        return out


def sweep_seed(scenario_seed: int) -> int:
    """The seed `cache_aware_swept` is tuned on: never the one it is evaluated on."""
    return scenario_seed + 1


def sweep_cache_aware(scenario_path: str, seed: int, sweep_iterations: int | None, jobs: int,
                      on_done: Callable[[RunSpec, FleetResult], None] | None = None,
                      ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The grid on the scenario under `seed` (pass `sweep_seed(evaluation seed)`), at full
    length unless `sweep_iterations` says otherwise; returns (best params, every point)."""
    from broker.policies.cache_aware import cache_aware_grid

    specs = [RunSpec("cache_aware", tuple(sorted(p.items())), sweep_iterations) for p in cache_aware_grid()]
    results = run_many(scenario_path, seed, specs, jobs, on_done)
    points = [{"params": dict(s.params), "tokens_per_s": r.metrics.tokens_per_s}
              for s, r in zip(specs, results)]
    best = max(points, key=lambda p: p["tokens_per_s"])  # ties: the first in grid order
    return best["params"], points


def headroom(results: dict[str, FleetResult], bound: float) -> dict[str, Any] | None:
    """What the fluid bound leaves above the scenario's best router baseline (None without
    one): no policy's throughput exceeds the bound (a test holds the simulator to it), so
    `bound_x_best` is the largest ×best any policy can reach there. `preemptions_per_session`
    is the best baseline's (per finished session: above CONTENDED_PREEMPTIONS_PER_SESSION, the
    scenario is contended)."""
    base = {n: r.metrics for n, r in results.items() if n in BASELINES}
    if not base:
        return None
    name = max(base, key=lambda n: base[n].tokens_per_s)
    m = base[name]
    finished = m.sessions_per_s * m.span_s
    return {"best_baseline": name, "best_tokens_per_s": m.tokens_per_s,
            "bound_x_best": bound / m.tokens_per_s if m.tokens_per_s > 0 else None,
            "preemptions_per_session": m.preemptions / finished if finished else None}


def result_json(result: FleetResult, params: dict[str, Any]) -> dict[str, Any]:
    m = asdict(result.metrics)
    m["drift_per_iteration"] = list(m["drift_per_iteration"])
    return {
        "metrics": m,
        "params": {k: v for k, v in params.items() if k != "true_output_lengths"},
        "completed": result.completed,
        "iterations_done": len(result.iterations),
        "sim_time_s": result.sim_time_s,
        "decide_calls": result.decide_calls,
        "sessions_finished": len(result.sessions),
        "engines": [asdict(e) for e in result.engines],
    }


def write_json(path: str | Path, report: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
