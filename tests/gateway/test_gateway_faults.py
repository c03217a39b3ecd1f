"""Faults around the gateway: a gateway killed with SIGKILL mid-run, a backend that dies under
an episode. No episode is lost, no result duplicated, every result token-exact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from broker.redis_server import free_port
from tests.broker.helpers import wait_until
from tests.gateway.helpers import check_token_exact, engine_view, fleet
from tests.gateway.test_gateway import agent

pytestmark = pytest.mark.timeout(180)


def start_gateway(redis_url: str, namespace: str, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_broker.cli", "gateway", "--port", str(port),
         "--redis-url", redis_url, "--namespace", namespace, "--log-level", "WARNING"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    url = f"http://127.0.0.1:{port}/healthz"

    def up() -> bool:
        try:
            return httpx.get(url, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False
    assert wait_until(up, timeout=30, every=0.1), proc.stderr.read1().decode() if proc.poll() else ""
    return proc


class Agents:
    """`agent` in a thread per episode (its base URL); what each ended with, and any error.
    With `hold_at`, each agent waits before its call `hold_at` until `release()` (an agent that
    fails first counts as held, so the test sees its error at once instead of waiting out the
    hold)."""

    def __init__(self, base_urls: dict[str, str], turns: int, hold_at: int | None = None) -> None:
        self.done: dict[str, list] = {}
        self.errors: list[BaseException] = []
        self.held = threading.Semaphore(0)
        self._gate = threading.Event()

        def before_turn(k: int) -> None:
            if k == hold_at:
                self.held.release()
                self._gate.wait(timeout=120)

        def run(sid: str, base: str) -> None:
            try:
                self.done[sid] = agent(base, turns, before_turn=before_turn)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.errors.append(exc)
                self.held.release()

        self.threads = [threading.Thread(target=run, args=item, daemon=True)
                        for item in base_urls.items()]
        for t in self.threads:
            t.start()

    def running(self) -> int:
        return sum(t.is_alive() for t in self.threads)

    def all_held(self, timeout: float = 60.0) -> bool:
        """Whether every agent reached its hold within `timeout`."""
        return all(self.held.acquire(timeout=timeout) for _ in self.threads)

    def release(self) -> None:
        self._gate.set()

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=120)


def test_a_gateway_killed_mid_run_loses_and_duplicates_nothing(redis_url, namespace):
    n, turns = 16, 4
    with fleet(redis_url, namespace, engines=2, time_scale=20.0) as f:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        for i in range(n):
            f.client.open_episode({"session_id": f"ep{i}", "workload": "agentic",
                                   "max_tokens": 256,
                                   "metadata": {"sim_output_tokens": 150}}, url)
        gw = start_gateway(redis_url, namespace, port)
        agents = Agents({f"ep{i}": f"{url}/sessions/ep{i}/v1" for i in range(n)}, turns)
        time.sleep(1.5)  # mid-run: calls in flight
        os.killpg(gw.pid, signal.SIGKILL)
        gw.wait()
        time.sleep(0.5)
        gw = start_gateway(redis_url, namespace, port)
        try:
            agents.join()
        finally:
            os.killpg(gw.pid, signal.SIGTERM)
            gw.wait(timeout=20)
        assert not agents.errors, agents.errors[:3]
        assert len(agents.done) == n
        close_and_check_once(f, [f"ep{i}" for i in range(n)], turns)


def close_and_check_once(f, episodes: list[str], turns: int) -> None:
    """Close every episode: exactly one result each, with all its calls, token-exact."""
    for i, sid in enumerate(episodes):
        assert f.client.close_episode(sid, float(i)) == "ok"
    results: list = []
    assert wait_until(lambda: len(results.__iadd__(f.client.results(len(episodes), timeout=0.5))
                                  or results) >= len(episodes), timeout=30, every=0)
    f.client.ack()
    assert sorted(r.session_id for r in results) == sorted(episodes)
    for r in results:
        assert r.turns == turns
        check_token_exact(r, _kept(engine_view(f, r.session_id), r))


def _kept(requests: list[dict], result) -> list[dict]:
    """A call the kill cut short ran again: the engine saw it twice; the result holds the run
    that was recorded (the one whose output the records hold)."""
    kept, i = [], 0
    for rec in result.turn_records:
        while requests[i]["output_token_ids"] != rec.output_token_ids:
            i += 1
        kept.append(requests[i])
        i += 1
    return kept


def test_a_dead_backend_moves_the_episode_and_the_agent_sees_only_latency(redis_url, namespace):
    with fleet(redis_url, namespace, engines=2) as f:
        base = f.open("ep-move", max_tokens=32)
        oa = openai.OpenAI(base_url=base, api_key="-")
        msgs = [{"role": "user", "content": "x"}]
        r = oa.chat.completions.create(model="m", messages=msgs)
        status = f.client.status()["backends"]
        first = next(b for b, s in status.items() if s["sessions"] == 1)
        other = next(b for b in status if b != first)
        before = engine_view(f, "ep-move", [first])
        f.stop_backend(first)  # the broker takes the episode back; the engine is gone
        msgs += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "y"}]
        oa.chat.completions.create(model="m", messages=msgs)
        assert f.client.close_episode("ep-move", 1.0) == "ok"
        [res] = f.client.results(1, timeout=10)
        assert res.backend_id == other
        # The second call ran on the other engine, from the whole history (no cache there).
        check_token_exact(res, before + engine_view(f, "ep-move", [other]))


def test_agents_ride_out_a_redis_restart_exactly_once(tmp_path):
    """Redis stops (SIGTERM, append-only file kept) for 3 s while 8 agents call through the
    gateway and starts again on the same port: the agents' clients retry the gateway's 503s,
    and every episode ends with one token-exact result."""
    from broker.redis_server import start_private_redis

    workdir = str(tmp_path / "redis")
    (tmp_path / "redis").mkdir()
    server = start_private_redis(appendonly=True, workdir=workdir,
                                 extra_args=("--appendfsync", "always"))
    port = int(server.url.rsplit(":", 1)[1].split("/")[0])
    try:
        with fleet(server.url, "ride", engines=2, time_scale=20.0) as f:
            n, turns = 8, 12
            for i in range(n):
                f.open(f"r{i}", max_tokens=64, metadata={"sim_output_tokens": 40})
            # Every agent makes two calls and waits; then all go on, and Redis stops while
            # their calls are in flight (ten calls each are left: a fast machine once ended an
            # episode within the 1 s this test waited before).
            agents = Agents({f"r{i}": f"{f.gateway.url}/sessions/r{i}/v1" for i in range(n)},
                            turns, hold_at=2)
            assert agents.all_held() and not agents.errors, agents.errors[:3]
            agents.release()
            time.sleep(0.1)
            running = agents.running()
            server.process.terminate()
            server.process.wait(timeout=10)
            time.sleep(3.0)
            server = start_private_redis(appendonly=True, port=port, workdir=workdir,
                                         extra_args=("--appendfsync", "always"))
            agents.join()
            assert running == n, "the outage must come while the agents call"
            assert not agents.errors, agents.errors[:3]
            close_and_check_once(f, [f"r{i}" for i in range(n)], turns)
    finally:
        server.close()
