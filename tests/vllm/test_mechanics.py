"""The simulated engine and real vLLM agree on the mechanics the simulator models, to the token,
on the same traces (sim/mechanics.py; benchmarks/engine_mechanics.py prints the table that
docs/engine-model.md shows). Seed 0 is the fixed trace; seed 3 is the draw with the most
preemptions of the eight in the docs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm.conftest import TinyModels

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
COUNTERS = ("queries", "hits", "preempted_queries", "preempted_hits", "preemptions")


def agreeing_rows(model: Path, out: Path, *args: str) -> list[dict]:
    """`benchmarks/engine_mechanics.py` on seeds 0 and 3 (with `args`); its rows, each checked:
    every counter, every request and the order of every pair the same on both engines."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine_mechanics.py"),
                           "--model", str(model), "--seeds", "0,3", "--json", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["seed"], r["phase"]) for r in rows] == [
        (s, p) for s in (0, 3)
        for p in ("shared prefixes", "multi-turn", "thrash", "thrash, next turns")]
    for r in rows:
        where = f"seed {r['seed']}, {r['phase']}"
        for k in COUNTERS:
            assert r[f"{k}_sim"] == r[f"{k}_vllm"], f"{where}: {k}"
        assert r["requests_alike"] == r["requests"], where
        assert r["same_order_share"] == 1.0, where
    return rows


def test_prefix_hits_preemptions_recompute_hits_and_finish_order_agree_with_vllm(
        tiny_models: TinyModels, tmp_path):
    rows = agreeing_rows(tiny_models.seed0, tmp_path / "mechanics.json")
    thrash = [r for r in rows if r["phase"].startswith("thrash")]
    assert all(r["preemptions_vllm"] > 0 and r["preempted_queries_vllm"] > 0 for r in thrash)


def test_priority_scheduling_agrees_with_vllm(tiny_models: TinyModels, tmp_path):
    """Both engines under --scheduling-policy priority, the trace's long requests with
    priorities: who waits, whom a full cache preempts and what its recompute finds agree."""
    rows = agreeing_rows(tiny_models.seed0, tmp_path / "mechanics-priority.json",
                         "--scheduling-policy", "priority")
    assert sum(r["preemptions_vllm"] for r in rows) > 0
