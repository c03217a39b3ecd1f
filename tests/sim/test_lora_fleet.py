"""LoRA adapters in the fleet simulator (`fleet.max_loras`, `workloads.*.adapters`): each
engine mixes at most `max_loras` adapters, a turn without a slot waits and an adapter loads
once per engine; every policy delivers every session once; MISA-T, which places by slot, makes
no turn wait; the draws are the same with or without adapters; bad specs name the field."""

from __future__ import annotations

import typing

import pytest
import yaml

from broker.policies import make_policy
from sim.fleet import FleetSim
from sim.scenario import ScenarioError, load_scenario, parse_scenario
from sim.workloads.generators import generate_group
from sim.workloads.source import make_source

LORA = "scenarios/lora.yaml"
POLICIES = ("round_robin", "least_loaded", "power_of_two", "cache_aware", "misa_t")


def scenario(iterations: int = 20, **changes: typing.Any) -> typing.Any:
    data = yaml.safe_load(open(LORA))
    data["trainer"]["iterations"] = iterations
    for path, value in changes.items():
        *keys, last = path.split("__")
        node = data
        for k in keys:
            node = node[k]
        node[last] = value
    return parse_scenario(data, origin="lora-test")


class Watched(FleetSim):
    """Records, for every engine request the simulator submits, the adapters with a request on
    that engine at that moment (this one included)."""

    def __init__(self, *args: typing.Any, **kwargs: typing.Any) -> None:
        super().__init__(*args, **kwargs)
        self.mixed: list[tuple[str, int]] = []

    def _start_turn(self, live: typing.Any) -> None:
        before = live.request
        super()._start_turn(live)
        if live.request is not None and live.request is not before:
            b = live.backend
            held = {other.sim.session.adapter for other in self.by_request.values()
                    if other.backend == b and other.sim.session.adapter is not None}
            self.mixed.append((b, len(held)))


def run(policy: str, sc: typing.Any) -> tuple[Watched, typing.Any]:
    sim = Watched(sc, make_policy(policy), make_source(sc, LORA), check=True)
    return sim, sim.run()


@pytest.mark.parametrize("policy", POLICIES)
def test_every_session_once_and_no_engine_past_its_slots(policy):
    sc = scenario()
    sim, res = run(policy, sc)
    ids = [s.session_id for s in res.sessions]
    assert len(ids) == len(set(ids)) == sc.trainer.iterations * sc.trainer.batch_size
    assert sim.mixed and max(n for _, n in sim.mixed) <= sc.fleet.max_loras
    lora = res.metrics.lora
    assert lora is not None and lora.loads >= 1
    # Each engine loads an adapter at most once while it stays loaded: loads are bounded by
    # the turns, and happen at all (12 adapters, 4 engines).
    assert lora.loads <= len(sim.mixed)


def test_misa_t_places_by_slot_and_no_turn_waits_where_routers_wait():
    sc = scenario()
    _, misa = run("misa_t", sc)
    _, router = run("cache_aware", sc)
    assert misa.metrics.lora.slot_waits == 0
    assert router.metrics.lora.slot_waits > 0
    assert misa.metrics.lora.loads < router.metrics.lora.loads


def test_adapters_change_only_which_adapter_a_group_uses():
    with_adapters = load_scenario(LORA)
    data = yaml.safe_load(open(LORA))
    for w in data["workloads"].values():
        w.pop("adapters", None)
    plain = parse_scenario(data, origin="no-adapters")
    for workload in with_adapters.workloads:
        for index in range(20):
            a, b = generate_group(with_adapters, workload, index), generate_group(plain, workload,
                                                                                  index)
            assert [s.truth for s in a] == [s.truth for s in b]
            assert [s.session.model_copy(update={"adapter": None}) for s in a] == \
                [s.session for s in b]
            assert len({s.session.adapter for s in a}) == 1  # one adapter per GRPO group
    used = {generate_group(with_adapters, "rlvr", i)[0].session.adapter for i in range(200)}
    assert used == {f"rlvr-a{k}" for k in range(4)}


def test_adapters_need_engines_with_lora_on():
    with pytest.raises(ScenarioError, match=r"workloads\.rlvr\.adapters: LoRA adapters need "
                                            "engines with LoRA on: set fleet.max_loras"):
        scenario(fleet__max_loras=0)
