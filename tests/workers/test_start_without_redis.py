"""Processes that start while Redis does not answer: they wait for it, serve once it answers,
and stop at once on SIGTERM while they wait, with the children they started (issue 46,
finding 2: a worker there ignored SIGINT and SIGTERM, and the tool worker crashed)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker.redis_server import free_port, start_private_redis
from tests.workers.test_tools_rq import call
from workers.tools import RqExecutor

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rollout_broker.cli", *args], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _wait_for_line(p: subprocess.Popen, text: str, timeout: float = 60.0) -> list[str]:
    """Read `p`'s stderr until a line holds `text` (the lines so far; fails on exit or time)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stderr.readline()
        if not line:
            pytest.fail(f"exited ({p.wait()}) before saying {text!r}: {''.join(lines)[-2000:]}")
        lines.append(line)
        if text in line:
            return lines
    pytest.fail(f"did not say {text!r} within {timeout:.0f} s")


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(x) for x in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True)
    return not out.stdout.strip().startswith("Z")


def test_a_worker_waiting_for_redis_at_start_stops_on_sigterm_with_its_engine():
    port = free_port()  # nothing listens there
    p = _start(["worker", "--backend-id", "w-start", "--engine", "sim:h100-8b",
                "--redis-url", f"redis://127.0.0.1:{port}/0"])
    try:
        _wait_for_line(p, "redis unavailable")
        engines = _children(p.pid)
        assert engines, "the worker should have started its simulated engine"
        time.sleep(1.0)  # well into its wait
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=15) == 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(map(_alive, engines)):
            time.sleep(0.1)
        assert not any(map(_alive, engines)), "its engine outlived it"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_tool_worker_started_before_redis_waits_serves_and_stops_on_sigterm(tmp_path):
    port = free_port()
    p = _start(["tools", "--redis-url", f"redis://127.0.0.1:{port}/0"])
    server = None
    try:
        _wait_for_line(p, "redis unavailable")
        time.sleep(1.5)
        assert p.poll() is None, "the tool worker should wait for Redis, not exit"
        server = start_private_redis(port=port, workdir=str(tmp_path))

        async def one_call() -> int:
            ex = RqExecutor(server.url, timeout_s=20.0, retries=0, poll_s=0.05)
            try:
                return len((await ex.call_tool(call("sim", turn=1))).observation_token_ids)
            finally:
                await ex.aclose()

        assert asyncio.run(one_call()) == 9  # served by the worker that waited
        server.process.kill()  # Redis goes away again: SIGTERM while it waits
        server.process.wait()
        time.sleep(1.0)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=15) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if server is not None:
            server.close()
