"""benchmarks/live_ab.py on real engines: its options are checked before anything starts (the
runs themselves take minutes; docs/results/misa-t.md §1c has their figures)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scripts import load_script
from tests.vllm.conftest import TinyModels

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def live_ab():
    return load_script(ROOT / "benchmarks" / "live_ab.py")


def test_real_engines_need_a_scenario_in_the_models_vocabulary(live_ab, tiny_models: TinyModels):
    args = ["--engine", f"vllm:{tiny_models.seed0} --block-size 32"]
    with pytest.raises(SystemExit, match=r"--scenario: its vocab_size \(128256\) is larger than "
                                         r"the model's vocabulary \(2048\)"):
        live_ab.plan(live_ab.parse_args([*args, "--scenario", str(ROOT / "scenarios/demo.yaml")]))
    pl = live_ab.plan(live_ab.parse_args([*args, "--scenario",
                                          str(ROOT / "scenarios/cpu-tiny.yaml")]))
    assert pl.vllm.target == str(tiny_models.seed0) and pl.vllm.args == ("--block-size", "32")
    assert pl.engine_label == "vLLM seed0 --block-size 32"
