"""`benchmarks/scale.py --quick` runs end to end (private Redis, broker thread and process, API,
simulator) and its JSON holds every figure as a finite number. No timing is asserted: the
figures are measurements for docs/measurement.md, not checks."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from broker.redis_server import find_redis_server_binary
from tests.scripts import load_script

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

ROOT = Path(__file__).resolve().parent.parent

REQUIRED = [
    *(f"admission.{p}.{k}" for p in ("misa_t", "least_loaded") for k in (
        "admission_per_s", "drain_decide_median_ms", "drain_decide_p99_ms",
        "steady_decide_median_ms", "steady_decide_p99_ms", "heartbeats_per_s")),
    *(f"memory.{t}.{k}" for t in ("150", "3700") for k in (
        "bytes_per_pending", "stream_bytes_per_entry", "hash_bytes_per_session",
        "session_json_bytes")),
    "million.redis_bytes_per_pending", "million.redis_used_memory_bytes",
    "million.enqueue_wall_s", "million.broker_rss_bytes", "million.broker_rss_empty_bytes",
    "million.status_p50_ms", "million.status_p99_ms",
    "simulator.slope_s_per_engine", "simulator.r2", "simulator.loglog_exponent",
]


def test_scale_quick_reports_every_figure(tmp_path: Path) -> None:
    if find_redis_server_binary() is None:
        pytest.skip("no redis-server binary to start a private Redis with")
    out = tmp_path / "scale.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--quick",
                           "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=140, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "figure" in proc.stdout and "/v1/status" in proc.stdout
    report = json.loads(out.read_text())
    figures = report["figures"]
    missing = [k for k in REQUIRED if k not in figures]
    assert not missing, missing
    assert len([k for k in figures if k.startswith("simulator.wall_s.")]) == 3
    bad = {k: v for k, v in figures.items()
           if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v)}
    assert not bad, bad
    # /v1/status saw the big namespace (less what the broker admitted before it was read).
    assert figures["million.status_depth"] > report["config"]["million"] / 2


def test_the_drain_window_holds_the_calls_that_admitted_it_however_few():
    drain_calls = load_script(ROOT / "benchmarks" / "scale.py").drain_calls

    # (start, seconds, admitted): a drain of 3,000 taken in two calls, both starting before the
    # 10 % mark on the clock, then steady calls.
    calls = [(0.0, 0.1, 2_400), (0.1, 0.05, 600), (5.0, 0.01, 3), (6.0, 0.01, 0)]
    assert drain_calls(calls, 300, 2_700) == calls[:2]
    # Calls wholly before 10 % or after 90 % are not the window's; those that admit none inside
    # it are.
    calls = [(0.0, 0.1, 100), (0.1, 0.1, 400), (0.2, 0.1, 0), (0.3, 0.1, 400), (0.4, 0.1, 100),
             (0.5, 0.1, 5)]
    assert drain_calls(calls, 100, 900) == calls[1:4]
