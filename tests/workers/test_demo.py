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
    p = subprocess.run([sys.executable, "-m", "rollout_broker.cli", "demo", "--duration", "20",
                        "--engines", "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=150)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert f"(private: nothing answered at {dead} ($REDIS_URL)" in out and "summary:" in out
    namespace = re.search(r"namespace (demo-[0-9a-f]+)", out).group(1)
    done = re.search(r"│\s*all\s*│\s*(\d+)\s*│\s*(\d+)", out)
    assert done and int(done.group(1)) > 0 and int(done.group(2)) == 0, out[-3000:]
    left = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    assert namespace not in left, "a demo child outlived the demo"
    port = re.search(r"redis redis://127.0.0.1:(\d+)", out).group(1)
    assert f"--port {port}" not in left, "the private Redis outlived the demo"
    # Shut down in dependency order (broker, workers drained, then their engines): a clean run
    # logs no error, and hands nothing back for want of an engine.
    logdir = Path(re.search(r"logs (/\S+)", out).group(1))
    for log in sorted(logdir.glob("*.log")):
        bad = [line for line in log.read_text(errors="replace").splitlines()
               if " ERROR " in line or "Traceback" in line or "engine down" in line]
        assert bad == [], f"{log.name}: {bad[:3]}"


@pytest.mark.redis
def test_the_rq_demo_leaves_no_tool_jobs_in_a_redis_it_does_not_own(redis_url):
    """On someone else's Redis the demo deletes what it wrote, its RQ queues and jobs too
    (RQ keeps queued jobs forever: each run used to leave its unfinished calls behind)."""
    import redis

    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="160")
    p = subprocess.run([sys.executable, "-m", "rollout_broker.cli", "demo", "--duration", "6",
                        "--engines", "2", "--tools", "rq", "--tool-workers", "3",
                        "--redis-url", redis_url], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=150)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    namespace = re.search(r"namespace (demo-[0-9a-f]+)", out).group(1)
    done = re.search(r"│\s*all\s*│\s*(\d+)\s*│\s*(\d+)", out)
    assert done and int(done.group(1)) > 0 and int(done.group(2)) == 0, out[-3000:]
    r = redis.Redis.from_url(redis_url)
    try:
        left = [k for k in r.scan_iter(match=f"*{namespace}*", count=1000)]
        jobs = [k for k in r.scan_iter(match="rq:job:*", count=1000)
                if namespace in (r.hget(k, "origin") or b"").decode()]
    finally:
        r.close()
    assert left == [] and jobs == []


def test_the_demo_trainer_keeps_a_group_that_does_not_fit_yet():
    """A drawn group that would exceed the in-flight bound is enqueued later, never dropped:
    every group the trainer draws reaches the broker, in order."""
    from rollout_broker.demo import Trainer
    from sim.scenario import load_scenario

    class Client:
        def __init__(self) -> None:
            self.enqueued: list[str] = []

        def enqueue(self, sessions) -> list[str]:
            self.enqueued += [s.session_id for s in sessions]
            return [s.session_id for s in sessions]

    scenario = load_scenario(ROOT / "scenarios" / "demo.yaml")
    client = Client()
    trainer = Trainer(client, scenario, dict(scenario.mixture))
    for _ in range(20):  # fill up; then a few sessions finish, room for some groups, and so on
        trainer.top_up()
        assert trainer.stats.in_flight <= scenario.trainer.inflight_bound
        trainer.stats.results += [(None, 0.0)] * 5
    groups = [sid.rsplit("-", 1)[0] for sid in client.enqueued]
    for w in scenario.mixture:
        seen = list(dict.fromkeys(g for g in groups if g.startswith(f"{w}-g")))
        assert seen == [f"{w}-g{i:06d}" for i in range(len(seen))], (w, seen)


def test_ctrl_c_stops_the_demo_cleanly_with_status_130():
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="160")
    p = subprocess.Popen([sys.executable, "-m", "rollout_broker.cli", "demo", "--duration", "120",
                          "--engines", "2"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        seen = ""
        deadline = time.monotonic() + 90
        while "starting 2 engines" not in seen and time.monotonic() < deadline:
            seen += p.stdout.readline()
        assert "starting 2 engines" in seen, seen[-2000:]
        time.sleep(3)
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=90)
    finally:
        if p.poll() is None:  # (its children lead process groups of their own: stop them too)
            for child in children_of(p.pid):
                try:
                    os.killpg(child, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.kill()
    assert p.returncode == 130, (seen + out)[-3000:]
    assert "stopped early by interrupt" in out and "summary:" in out


def children_of(pid: int) -> list[int]:
    """The pids whose parent is `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2:].split()[1]) == pid:
                out.append(int(entry))
    return out
