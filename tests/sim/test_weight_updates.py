"""The simulator's weight updates (`trainer.weight_update`): pause every engine, load weights for
`sync_s`, resume; what each pause mode does to requests in flight; what the bench reports."""

from __future__ import annotations

import json
import typing

import pytest
import yaml
from rich.console import Console

from broker.policies import make_policy
from sim.engine.core import EngineCore
from sim.engine.profiles import get_profile
from sim.engine.request import EngineRequest, FinishReason
from sim.fleet import FleetSim
from sim.scenario import ScenarioError, parse_scenario
from sim.workloads.source import make_source

QUICK = "scenarios/quick.yaml"


def scenario(iterations: int = 3, **trainer: typing.Any) -> typing.Any:
    data = yaml.safe_load(open(QUICK))
    data["trainer"].update({"iterations": iterations, "batch_size": 16, "inflight_bound": 32,
                            **trainer})
    return parse_scenario(data, origin="tiny")


class Watched(FleetSim):
    """Records the fleet's generated-token total when every engine is paused and at resume."""

    def __init__(self, *args: typing.Any, **kwargs: typing.Any) -> None:
        super().__init__(*args, **kwargs)
        self.windows: list[tuple[float, int, float, int]] = []  # (paused at, tokens, resumed at, tokens)
        self._at_pause: tuple[float, int] | None = None
        self.drains: list[float] = []

    def generated(self) -> int:
        return sum(e.stats().generation_tokens_total for e in self.engines.values())

    def _paused(self) -> None:
        self._at_pause = (self.now, self.generated())
        self.drains.append(self.now - self._pause.started_at)
        super()._paused()

    def _resume(self) -> None:
        assert self._at_pause is not None
        self.windows.append((*self._at_pause, self.now, self.generated()))
        super()._resume()


def run(policy: str = "misa_t", iterations: int = 3, **trainer: typing.Any) -> tuple[Watched, typing.Any]:
    sc = scenario(iterations, **trainer)
    sim = Watched(sc, make_policy(policy), make_source(sc, QUICK))
    return sim, sim.run()


def true_output(sim: FleetSim) -> dict[str, tuple[int, ...]]:
    return {s.session_id: s.truth.output_tokens for s, _ in sim.enqueued}


def test_engine_freeze_shifts_a_request_by_the_frozen_time() -> None:
    def finish(freeze_at: float | None) -> float:
        core = EngineCore(get_profile("h100-8b"), kv_tokens=60_000, seed=1)
        core.add_request(EngineRequest("r", list(range(1, 200)), max_tokens=400, output_len=400))
        if freeze_at is not None:
            core.advance(freeze_at)
            core.freeze(freeze_at)
            assert core.advance(freeze_at + 10.0) == [] and core.next_event_time() is None
            frozen_tokens = core.requests["r"].num_output_tokens
            core.advance(freeze_at + 10.0)
            assert core.requests["r"].num_output_tokens == frozen_tokens  # nothing moves
            core.unfreeze(freeze_at + 10.0)
        (req,) = core.run_until_idle()
        assert req.num_output_tokens == 400
        return req.finish_time

    free = finish(None)
    shifted = finish(free / 2)
    step = free / 400 * 2  # comfortably more than one decode step
    assert free + 10.0 - step <= shifted <= free + 10.0


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
def test_nothing_is_generated_while_paused_and_every_update_is_counted(mode: str) -> None:
    sim, res = run(weight_update={"mode": mode, "sync_s": 4.0})
    wu = res.metrics.weight_updates
    assert res.completed and wu is not None
    assert wu.updates == len(sim.windows) == 2  # after iterations 1 and 2 of 3
    for paused_at, before, resumed_at, after in sim.windows:
        assert after == before  # not one token while the weights change
        assert resumed_at - paused_at == pytest.approx(4.0)
    assert wu.paused_s == pytest.approx(sum(r - p for p, _, r, _ in sim.windows) + wu.drain_s)
    aborted = sum(e.stats().requests_finished_total[FinishReason.abort] for e in sim.engines.values())
    if mode == "abort":
        assert aborted > 0 and wu.tokens_kept > 0 and wu.reprefill_tokens > wu.tokens_kept
    else:
        assert aborted == 0 and wu.tokens_kept == wu.reprefill_tokens == 0
    if mode == "wait":
        assert wu.drain_s > 0  # requests in flight finished first
    if mode == "keep":
        assert wu.drain_s == 0
    assert wu.tokens_thrown_away == 0


@pytest.mark.parametrize("policy", ["misa_t", "cache_aware"])
def test_partial_rollouts_resume_without_regenerating_what_they_kept(policy: str) -> None:
    sim, res = run(policy, weight_update={"mode": "abort", "sync_s": 2.0})
    assert res.metrics.weight_updates.tokens_kept > 0
    truth = true_output(sim)
    ids = [r.session_id for r in res.sessions]
    assert len(ids) == len(set(ids))
    for r in res.sessions:  # each turn exactly as long as the truth: kept tokens count once
        assert r.output_tokens == sum(truth[r.session_id][:r.turns]), r.session_id


def test_without_partial_rollouts_the_stopped_output_is_thrown_away_and_regenerated() -> None:
    sim, res = run(weight_update={"mode": "abort", "sync_s": 2.0, "partial": False})
    wu = res.metrics.weight_updates
    assert wu.tokens_kept == 0 and wu.tokens_thrown_away > 0
    truth = true_output(sim)
    for r in res.sessions:
        assert r.output_tokens == sum(truth[r.session_id][:r.turns])
    generated = sum(e.stats().generation_tokens_total for e in sim.engines.values())
    assert generated >= sum(r.output_tokens for r in res.sessions) + wu.tokens_thrown_away


def test_the_trainer_trains_one_batch_at_a_time_and_pushes_after_each() -> None:
    """Batches that complete while the trainer trains or pushes wait their turn: every push
    starts `train_s` after the previous resume at the earliest, never right after it."""
    sim, res = run(iterations=6, train_s=20.0, weight_update={"mode": "wait", "sync_s": 2.0})
    wu = res.metrics.weight_updates
    starts = [p - d for (p, _, _, _), d in zip(sim.windows, sim.drains)]
    resumes = [r for _, _, r, _ in sim.windows]
    assert wu.updates == len(sim.windows) >= 2
    for prev_resume, start in zip(resumes, starts[1:]):
        assert start >= prev_resume + 20.0 - 1e-9
    assert starts[0] >= res.iterations[0].done_at + 20.0 - 1e-9


def test_a_sync_step_waits_for_the_weights() -> None:
    """keep leaves the prefix cache as it is, so each step runs exactly as without the
    update, `sync_s` later: every step after an update takes `sync_s` longer."""
    _, plain = run(iterations=4, loop="sync", train_s=3.0)
    _, upd = run(iterations=4, loop="sync", train_s=3.0,
                 weight_update={"mode": "keep", "sync_s": 7.0, "every": 2})
    assert upd.metrics.weight_updates.updates == 1  # after step 2 (none after the last)
    d_plain = [it.duration for it in plain.iterations]
    d_upd = [it.duration for it in upd.iterations]
    assert d_upd[:2] == pytest.approx(d_plain[:2])
    assert d_upd[2] == pytest.approx(d_plain[2] + 7.0)
    assert d_upd[3] == pytest.approx(d_plain[3])


@pytest.mark.parametrize(("trainer", "field"), [
    ({"weight_update": {"mode": "keep", "sync_s": 1.0, "partial": False}}, "partial"),
    ({"weight_update": {"mode": "abort"}}, "sync_s"),
    ({"weight_update": {"mode": "drop", "sync_s": 1.0}}, "mode"),
    ({"train_s": 5.0}, "train_s"),
])
def test_bad_weight_update_settings_name_the_field(trainer: dict, field: str) -> None:
    with pytest.raises(ScenarioError, match=field):
        scenario(**trainer)


def test_bench_reports_what_updates_cost(tmp_path) -> None:
    from sim.bench_cli import bench

    data = yaml.safe_load(open(QUICK))
    data["trainer"].update({"iterations": 2, "batch_size": 16, "inflight_bound": 32,
                            "weight_update": {"mode": "abort", "sync_s": 2.0}})
    path = tmp_path / "wu.yaml"
    path.write_text(yaml.safe_dump(data))
    console = Console(record=True, width=200)
    report = bench(str(path), ["misa_t"], None, str(tmp_path / "out.json"), plots_dir=None,
                   jobs=1, sweep_iterations=None, console=console)
    wu = report["policies"]["misa_t"]["metrics"]["weight_updates"]
    assert wu["updates"] == 1 and wu["tokens_kept"] > 0 and wu["tokens_thrown_away"] == 0
    assert json.loads((tmp_path / "out.json").read_text())["policies"]["misa_t"]["metrics"][
        "weight_updates"] == wu
    text = console.export_text()
    assert "weight updates" in text and f"{wu['tokens_kept']:,}" in text
