"""`rollout-broker demo` from nothing: no Redis at $REDIS_URL, exit 0, no process left behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from broker.redis_server import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parents[2]


def test_demo_starts_its_own_redis_and_exits_cleanly():
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    env = dict(os.environ, REDIS_URL=dead, PYTHONPATH=str(ROOT), COLUMNS="160")
    p = subprocess.run([sys.executable, "-m", "broker.cli", "demo", "--duration", "20",
                        "--engines", "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=150)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "(private)" in out and "summary:" in out
    namespace = re.search(r"namespace (demo-[0-9a-f]+)", out).group(1)
    done = re.search(r"│\s*all\s*│\s*(\d+)\s*│\s*(\d+)", out)
    assert done and int(done.group(1)) > 0 and int(done.group(2)) == 0, out[-3000:]
    left = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    assert namespace not in left, "a demo child outlived the demo"
    port = re.search(r"redis redis://127.0.0.1:(\d+)", out).group(1)
    assert f"--port {port}" not in left, "the private Redis outlived the demo"
