"""A benchmark stopped with SIGTERM stops what it started: `benchmarks/weight_update.py` runs
its engines, workers and broker in process groups of their own, which a signal to the
benchmark does not reach, so without `run_until_interrupted` they kept running after it (and
loaded the machine for whatever was measured next)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parent.parent


def children_of(pid: int) -> set[int]:
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces, so split after its closing paren
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.add(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def benchmark_namespaces(client) -> set[bytes]:
    return {key.split(b"}")[0] for key in client.scan_iter(match="rb:{wu-*", count=1000)}


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process parents from /proc")
def test_sigterm_stops_the_processes_the_benchmark_started(redis_url, redis_client) -> None:
    """...and leaves none of its keys in a Redis it did not start."""
    before = benchmark_namespaces(redis_client)
    # A long warm-up: the signal arrives while the fleet runs its first sessions.
    bench = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "weight_update.py"), "--workers", "1",
         "--modes", "keep", "--repeats", "1", "--sessions", "4", "--warmup", "60"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT), REDIS_URL=redis_url))
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while len(started) < 3 and time.monotonic() < deadline:  # engine, worker, broker
            assert bench.poll() is None, bench.communicate()[1][-3000:]
            started |= children_of(bench.pid)
            time.sleep(0.2)
        assert len(started) >= 3, f"only {len(started)} processes started"
        time.sleep(1.0)
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=60)
        assert bench.returncode == 130, err[-3000:]
        assert "interrupted" in err
        deadline = time.monotonic() + 10
        while any(alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in started if alive(p)], "left running after SIGTERM"
        assert benchmark_namespaces(redis_client) <= before, "keys left in Redis"
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for p in started:
            try:
                os.killpg(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
