"""The worker's weights hook (`rollout-broker worker --weights-hook`): a resume on a new policy
version loads that version's weights while the engine is still paused; a worker that starts
while the namespace serves a version loads it before anything is admitted to it; a hook that
fails hands the worker's sessions back with what they had generated, and the worker stops."""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager

import httpx
import pytest

from broker.client import RolloutClient
from broker.policies import make_policy
from broker.session import SessionState
from sim.server.testing import running_engine
from tests.broker.helpers import BrokerThread, wait_until
from tests.workers.helpers import WorkerThread, generation_tokens
from tests.workers.test_trainer_controls import OUTPUT, collect, engines_running, long_sessions
from workers.worker import WeightUpdate

pytestmark = pytest.mark.timeout(120)


class Hook:
    """Records each call: backend, version, whether the engine was paused and whether the
    backend could be admitted sessions (registered and healthy) at the time; raises on version
    `fail_on`."""

    def __init__(self, redis_url: str, namespace: str, fail_on: int | None = None) -> None:
        self.calls: list[tuple[str, int, bool, bool]] = []
        self.fail_on = fail_on
        self._client = RolloutClient(redis_url, namespace)
        self._lock = threading.Lock()

    def __call__(self, update: WeightUpdate) -> None:
        paused = httpx.get(f"{update.engine_url}/is_paused").json()["is_paused"]
        serving = healthy(self._client, update.backend_id)
        with self._lock:
            self.calls.append((update.backend_id, update.version, paused, serving))
        if update.version == self.fail_on:
            raise FileNotFoundError(f"no checkpoint for step {update.version}")


def healthy(client: RolloutClient, backend: str) -> bool:
    return bool(client.status()["backends"].get(backend, {}).get("healthy"))


@contextmanager
def fleet(redis_url: str, namespace: str, hook: Hook):
    """One simulated engine, its worker "w0" with `hook`, a broker and a client, once the
    worker is healthy: (engine, worker, client)."""
    with running_engine(time_scale=10.0, kv_tokens=200_000) as engine:
        worker = WorkerThread(redis_url, namespace, "w0", engine.url, time_scale=10.0,
                              weights_hook=hook).start()
        broker = BrokerThread(redis_url, namespace, make_policy("least_loaded")).start()
        client = RolloutClient(redis_url, namespace)
        try:
            assert wait_until(lambda: healthy(client, "w0"), timeout=30)
            yield engine, worker, client
        finally:
            broker.stop()
            worker.stop()
            client.close()


def test_a_new_version_is_loaded_while_the_engine_is_paused(redis_url, namespace):
    hook = Hook(redis_url, namespace)
    with fleet(redis_url, namespace, hook) as (engine, _, client):
        client.enqueue(long_sessions(4, "a"))
        assert wait_until(lambda: engines_running([engine.url]) >= 1, timeout=30)
        client.pause("abort")
        assert hook.calls == []  # a pause loads nothing
        client.resume(3)
        got = collect(client, 4)
        client.pause("keep")
        client.resume(3)  # the version the engine has: nothing to load
        client.enqueue(long_sessions(1, "b"))
        got += collect(client, 1)
    assert hook.calls == [("w0", 3, True, True)]
    assert [r.status for r in got] == [SessionState.done] * 5
    assert {s.policy_version for r in got for s in r.turn_records} <= {0, 3}
    assert got[-1].turn_records[0].policy_version == 3


def test_a_worker_starting_on_a_served_version_loads_it_before_it_is_admitted_anything(
        redis_url, namespace):
    hook = Hook(redis_url, namespace)
    with RolloutClient(redis_url, namespace) as client:
        assert client.pause("keep") == []  # no worker yet
        client.resume(5)
    with fleet(redis_url, namespace, hook) as (_, _, client):
        client.enqueue(long_sessions(1, "s"))
        got = collect(client, 1)
    assert hook.calls == [("w0", 5, False, False)]
    assert got[0].status == SessionState.done and got[0].turn_records[0].policy_version == 5


def test_a_failed_hook_hands_the_sessions_back_with_their_output_and_stops_the_worker(
        redis_url, namespace):
    """The engine stays paused on weights that did not load; the next worker resumes it (the
    namespace is not paused) and finishes the sessions from what they had."""
    hook = Hook(redis_url, namespace, fail_on=2)
    with fleet(redis_url, namespace, hook) as (engine, failing, client):
        client.enqueue(long_sessions(4, "f"))
        assert wait_until(lambda: engines_running([engine.url]) >= 4, timeout=30)
        client.pause("abort")
        client.resume(2)
        failing.thread.join(timeout=30)  # it stops by itself
        assert not failing.thread.is_alive()
        failure = failing.worker.failure or ""
        assert "policy version 2" in failure and "no checkpoint for step 2" in failure
        assert client.results(10, timeout=0.2) == []  # nothing published for them
        assert httpx.get(f"{engine.url}/is_paused").json()["is_paused"]  # not on those weights
        rescue = WorkerThread(redis_url, namespace, "w1", engine.url, time_scale=10.0).start()
        try:
            got = collect(client, 4)
        finally:
            rescue.stop()
        generated = generation_tokens(engine.url)
    assert hook.calls == [("w0", 2, True, True)]
    assert [r.status for r in got] == [SessionState.done] * 4
    assert all(r.output_tokens == OUTPUT for r in got)
    assert generated == 4 * OUTPUT  # handed back with what they had: nothing generated twice


def test_an_engine_that_comes_back_gets_the_served_version_again_before_it_serves(
        redis_url, namespace, redis_client):
    """It may have restarted on the weights it was started with."""
    from broker.keys import Keys
    from broker.redis_server import free_port
    from tests.workers.test_engine_faults import engine_process, wait_health

    hook = Hook(redis_url, namespace)
    with RolloutClient(redis_url, namespace) as client:
        client.pause("keep")
        client.resume(7)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = engine_process(port)
    beat = Keys(namespace).heartbeat("w0")
    try:
        wait_health(url)
        worker = WorkerThread(redis_url, namespace, "w0", url, weights_hook=hook).start()
        try:
            assert wait_until(lambda: redis_client.exists(beat), timeout=30)
            os.killpg(proc.pid, 9)
            proc.wait()
            assert wait_until(lambda: not redis_client.exists(beat), timeout=30)
            proc = engine_process(port)
            wait_health(url)
            assert wait_until(lambda: redis_client.exists(beat), timeout=30)
        finally:
            worker.stop()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert hook.calls == [("w0", 7, False, False)] * 2


def test_the_worker_command_exits_1_saying_which_version_did_not_load(redis_url, namespace,
                                                                     redis_client):
    import subprocess
    import sys

    from broker.keys import Keys
    from tests.workers.helpers import ROOT

    with RolloutClient(redis_url, namespace) as client:
        client.pause("keep")
        client.resume(9)
    proc = subprocess.run(
        [sys.executable, "-m", "rollout_broker.cli", "worker", "--backend-id", "w0", "--engine",
         "sim:h100-8b", "--kv-tokens", "40000", "--redis-url", redis_url, "--namespace",
         namespace, "--weights-hook", "tests.workers.tools_for_tests:missing_checkpoint",
         "--log-level", "CRITICAL"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=90)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "worker w0: weights hook: could not load policy version 9: FileNotFoundError: "
        "/ckpt/step-9 does not exist")
    assert not redis_client.exists(Keys(namespace).heartbeat("w0"))  # it never served
