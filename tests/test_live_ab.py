"""benchmarks/live_ab.py checks its options before anything starts (tests/vllm/test_live_ab.py
has the real-engine ones)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def live_ab():
    return load_script(ROOT / "benchmarks" / "live_ab.py")


def test_an_engine_that_is_neither_sim_nor_vllm_is_refused(live_ab):
    for bad in ("attach:http://x", "gpu:x"):
        with pytest.raises(SystemExit, match="--engine"):
            live_ab.plan(live_ab.parse_args(["--engine", bad]))
