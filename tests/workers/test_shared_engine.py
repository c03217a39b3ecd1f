"""One worker serving two namespaces on one engine (simulated, real Redis): each job's adapters
under names of their own in the engine, a job's pause that leaves the other job running, and
weight loading refused where the engine's weights are shared (docs/fleet.md)."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from broker.client import RolloutClient
from broker.policies import make_policy
from broker.session import Session, SessionState
from sim.server.testing import running_engine
from tests.broker.helpers import BrokerThread, collect, wait_until
from tests.workers.helpers import WorkerThread, prompt
from workers.main import EngineOptions, ToolOptions, WorkerConfigError, run_worker
from workers.worker import WorkerSettings

pytestmark = pytest.mark.timeout(120)


def sessions(tag: str, n: int, adapter: str | None = None, max_tokens: int = 64) -> list[Session]:
    return [Session(session_id=f"{tag}-{i}", workload="rlhf", prompt_token_ids=prompt(5, 64),
                    max_tokens=max_tokens, adapter=adapter,
                    sampling={"seed": 3, "temperature": 1.0, "ignore_eos": True})
            for i in range(n)]


@pytest.fixture
def two_jobs(redis_url):
    tag = uuid.uuid4().hex[:8]
    names = (f"ja-{tag}", f"jb-{tag}")
    with running_engine(time_scale=50.0, model_name="m", max_loras=2) as engine:
        worker = WorkerThread(redis_url, names[0], "w0", engine.url, time_scale=50.0,
                              tenants={names[0]: 0.5, names[1]: 0.5}).start()
        brokers = [BrokerThread(redis_url, ns, make_policy("misa_t")).start() for ns in names]
        clients = [RolloutClient(redis_url, ns) for ns in names]
        try:
            for c in clients:
                assert wait_until(lambda c=c: c.status()["backends"].get("w0", {}).get(
                    "healthy"), timeout=30)
            yield engine, clients
        finally:
            for b in brokers:
                b.stop()
            worker.stop()
            for c in clients:
                c.close()


def test_two_jobs_may_name_their_adapters_alike(two_jobs):
    engine, (a, b) = two_jobs
    a.register_adapter("math", "/ckpt/job-a/math")
    b.register_adapter("math", "/ckpt/job-b/math")
    a.enqueue(sessions("s", 2, "math"))
    b.enqueue(sessions("s", 2, "math"))
    outs = {}
    for job, client in (("a", a), ("b", b)):
        got = collect(client, 2)
        assert all(r.status == SessionState.done for r in got), [r.error for r in got]
        outs[job] = {tuple(r.output_token_ids[0]) for r in got}
    # Each job's "math" is its own adapter in the engine, loaded under the job's namespace.
    lora = httpx.get(f"{engine.url}/sim/lora").json()
    assert sorted(lora["adapters"].values()) == ["/ckpt/job-a/math", "/ckpt/job-b/math"]
    assert all(name.endswith("/math") and name != "math" for name in lora["adapters"])
    assert len(outs["a"]) == len(outs["b"]) == 1 and outs["a"] != outs["b"]


def test_a_jobs_pause_leaves_the_other_job_running(two_jobs):
    engine, (a, b) = two_jobs
    # A label an earlier job left on the engine's weights names no version of these jobs.
    httpx.post(f"{engine.url}/update_weight_version", json={"new_version": "7"}).raise_for_status()
    assert a.pause("keep") == ["w0"]  # acknowledged by the shared worker ...
    assert httpx.get(f"{engine.url}/is_paused").json()["is_paused"] is False  # ... engine serves
    a.enqueue(sessions("held", 2))
    b.enqueue(sessions("runs", 3))
    got = collect(b, 3)  # B's sessions run while A is paused
    assert all(r.status == SessionState.done for r in got)
    time.sleep(0.5)
    assert a.results(2, timeout=0.2) == []  # A's wait for its resume
    a.resume(1)
    got = collect(a, 2)
    assert all(r.status == SessionState.done for r in got)
    # Their tokens carry A's new version, not the engine's label.
    assert [[t.policy_version for t in r.turn_records] for r in got] == [[1], [1]]


def test_a_shared_engine_refuses_a_weights_hook(redis_url):
    settings = WorkerSettings(backend_id="w0", redis_url=redis_url)
    with pytest.raises(WorkerConfigError, match="^weights_hook: an engine several namespaces "
                                                "share serves one set of weights"):
        run_worker(settings, EngineOptions(spec="sim:h100-8b",
                                           weights_hook="tests.workers.helpers:prompt"),
                   ToolOptions(), tenants={"ja": 0.5, "jb": 0.5})
