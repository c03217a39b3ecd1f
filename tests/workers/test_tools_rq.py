"""RqExecutor against a real `rollout-broker tools` worker: results, raised errors, timeouts."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.workers.tools_for_tests import TOOLS_TOML
from workers.tools import RewardCall, RqExecutor, ToolCall, ToolError

pytestmark = pytest.mark.timeout(90)
ROOT = Path(__file__).resolve().parents[2]


def call(tool: str, turn: int = 0) -> ToolCall:
    return ToolCall(session_id="s1", workload="agentic", tool=tool, turn=turn, max_turns=3,
                    output_token_ids=[1, 2], context_tokens=10,
                    metadata={"sim_tool_latency_s": "0.1,0.1", "sim_observation_tokens": "7,9"},
                    time_scale=10.0)


def test_tools_and_rewards_through_rq(redis_url):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    worker = subprocess.Popen([sys.executable, "-m", "rollout_broker.cli", "tools", "--redis-url",
                               redis_url, "--tool-config", str(TOOLS_TOML)], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def go():
        ex = RqExecutor(redis_url, timeout_s=2.0, retries=1, poll_s=0.05)
        try:
            ok = await ex.call_tool(call("sim", turn=1))
            reward = await ex.score(RewardCall(session_id="s1", workload="rlvr", scorer="parity",
                                               output_token_ids=[[2, 4, 5, 7]]))
            with pytest.raises(ToolError, match="tool exploded") as boom:
                await ex.call_tool(call("boom"))
            with pytest.raises(ToolError, match="[Tt]imeout") as slow:
                await ex.call_tool(call("slow"))
            with pytest.raises(ToolError, match="'builtins.len' is not registered"):
                await ex.score(RewardCall(session_id="s2", workload="rlvr",
                                          scorer="builtins.len", output_token_ids=[[1]]))
            return ok, reward, str(boom.value), str(slow.value)
        finally:
            await ex.aclose()

    try:
        ok, reward, boom, slow = asyncio.run(go())
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    assert len(ok.observation_token_ids) == 9 and ok.done is False
    assert reward == 0.5
    assert "rq job" in boom and "rq job" in slow


@pytest.mark.redis
def test_a_tool_worker_rides_out_a_redis_restart(tmp_path):
    from broker.redis_server import free_port, start_private_redis

    port = free_port()
    redis_handle = start_private_redis(port=port, workdir=str(tmp_path))
    servers = [redis_handle]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    worker = subprocess.Popen([sys.executable, "-m", "rollout_broker.cli", "tools", "--redis-url",
                               redis_handle.url], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def one_call(ex: RqExecutor) -> int:
        out = await ex.call_tool(call("sim", turn=1))
        return len(out.observation_token_ids)

    async def go() -> tuple[int, int]:
        ex = RqExecutor(redis_handle.url, timeout_s=10.0, retries=0, poll_s=0.05)
        try:
            before = await one_call(ex)
            redis_handle.process.kill()  # Redis dies and comes back empty, on its address
            redis_handle.process.wait()
            await asyncio.sleep(2.0)
            assert worker.poll() is None  # the tool worker waits; it does not exit
            servers.append(start_private_redis(port=port, workdir=str(tmp_path)))
            after = await one_call(ex)  # taken by the same tool worker process
            return before, after
        finally:
            await ex.aclose()

    try:
        before, after = asyncio.run(go())
        assert worker.poll() is None
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        for server in servers:
            server.close()
    assert before == after == 9


@pytest.mark.redis
def test_rq_queues_are_per_namespace(redis_url, redis_client):
    from workers.tools import run_tool, tool_queues

    assert tool_queues("job-a") == ("rb:{job-a}:tools", "rb:{job-a}:rewards")  # keys.py's tag
    with pytest.raises(ValueError, match="namespace"):
        tool_queues("a:b")
    ex = RqExecutor(redis_url, "job-a", timeout_s=1.0)
    try:
        before = redis_client.llen("rq:queue:rb:{job-a}:tools")
        ex._enqueue("rb:{job-a}:tools", "tool sim", run_tool, call("sim").model_dump())
        assert redis_client.llen("rq:queue:rb:{job-a}:tools") == before + 1
        assert not redis_client.exists("rq:queue:rb:{job-b}:tools")
        assert ex._replies.startswith("rb:{job-a}:tool-replies:")
    finally:
        redis_client.delete("rq:queue:rb:{job-a}:tools")
        asyncio.run(ex.aclose())


def test_a_tool_worker_stopped_while_rq_registers_it_leaves_no_registration(redis_url, namespace):
    """RQ registers a worker before it installs its signal handlers; a SIGTERM in between
    (here made certain by slowing the subscribe of RQ's command listener, which sits in that
    window) must still end in RQ's clean stop, or the registration outlives the process by
    RQ's worker TTL and the `tools` probe calls a dead worker healthy."""
    import signal
    import time

    import redis
    from rq import Worker

    root = Path(__file__).resolve().parents[2]
    child = (
        "import sys, time\n"
        "import redis.client\n"
        "subscribe = redis.client.PubSub.subscribe\n"
        "def slow(self, *args, **kwargs):\n"
        "    print('registered', flush=True)\n"
        "    time.sleep(2.0)\n"
        "    return subscribe(self, *args, **kwargs)\n"
        "redis.client.PubSub.subscribe = slow\n"
        "from rollout_broker.cli import app\n"
        "sys.argv = ['rollout-broker', 'tools', '--redis-url', sys.argv[1], '--namespace', sys.argv[2]]\n"
        "app()\n"
    )
    p = subprocess.Popen([sys.executable, "-c", child, redis_url, namespace], cwd=root,
                         env=dict(os.environ, PYTHONPATH=str(root)), stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    conn = redis.Redis.from_url(redis_url)
    try:
        assert p.stdout.readline().strip() == "registered"
        mine = [w for w in Worker.all(connection=conn) if w.pid == p.pid]
        assert mine, "the worker should be registered by now"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
        deadline = time.time() + 5
        while time.time() < deadline and any(w.pid == p.pid for w in Worker.all(connection=conn)):
            time.sleep(0.1)
        assert not any(w.pid == p.pid for w in Worker.all(connection=conn))
    finally:
        if p.poll() is None:
            p.kill()
        for w in Worker.all(connection=conn):
            if w.pid == p.pid:
                w.register_death()
        conn.close()


def test_a_result_reaches_its_call_when_the_job_ends_not_at_the_next_poll(redis_url, namespace):
    """The job's success callback pushes the result to the executor; with a poll interval
    longer than the test, only that push can deliver it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    worker = subprocess.Popen([sys.executable, "-m", "rollout_broker.cli", "tools", "--redis-url",
                               redis_url, "--namespace", namespace], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def go():
        ex = RqExecutor(redis_url, namespace, timeout_s=30.0, retries=0, poll_s=600.0)
        try:
            out = await asyncio.wait_for(ex.call_tool(call("sim", turn=1)), 60)
            reward = await asyncio.wait_for(ex.score(RewardCall(
                session_id="s1", workload="rlvr", scorer="parity",
                output_token_ids=[[2, 4, 5, 7]])), 60)
            return len(out.observation_token_ids), reward
        finally:
            await ex.aclose()

    try:
        assert asyncio.run(go()) == (9, 0.5)
    finally:
        worker.terminate()
        worker.wait(timeout=30)


def test_a_reply_that_cannot_be_pushed_does_not_fail_the_job():
    """RQ counts a raising success callback as the job's failure and runs the tool again; the
    callback swallows the error (the caller's poll finds the result in RQ's record)."""
    from workers.tools import reply_to_caller

    class Job:
        id = "j1"
        meta = {"reply_to": "rb:{x}:tool-replies:1"}

    class DownRedis:
        def pipeline(self, transaction=True):
            raise ConnectionError("redis down")

    reply_to_caller(Job(), DownRedis(), {"done": True})  # does not raise
    Job.meta = {}
    reply_to_caller(Job(), None, 1.0)  # enqueued by an older executor: nothing to push to


def test_token_ids_travel_packed_and_reach_the_function_as_lists():
    """RQ stores a job's arguments twice; the token-id fields go packed, both ways."""
    import json

    from workers import tools

    c = call("sim", turn=1).model_dump()
    c["history_token_ids"] = list(range(0, 200_000, 97))
    wire = tools.pack_token_fields(c)
    assert isinstance(wire["history_token_ids"], str) and isinstance(wire["output_token_ids"], str)
    assert len(json.dumps(wire)) < len(json.dumps(c)) / 2
    assert tools.unpack_token_fields(wire) == c
    reward = RewardCall(session_id="s", workload="rlvr", scorer="parity",
                        output_token_ids=[[2, 4], [], [2**33]], token_ids=[1, 2, 3],
                        loss_mask=[0, 1, 1]).model_dump()
    wire = tools.pack_token_fields(reward)
    assert wire["output_token_ids"][1:] == [[], [2**33]]  # empty, and unpackable, stay lists
    assert tools.unpack_token_fields(wire) == reward
    seen = {}

    def spy_tool(d: dict) -> dict:
        seen.update(d)
        return {"observation_token_ids": [7, 8, 9], "done": False}

    registry = tools.ToolRegistry(tools={"spy": spy_tool}, rewards={})
    tools.use_registry(registry)
    try:
        out = tools.run_tool(tools.pack_token_fields({**c, "tool": "spy"}))
        assert seen["history_token_ids"] == c["history_token_ids"]  # plain lists, as sent
        assert isinstance(out["observation_token_ids"], str)
        assert tools.unpack_token_fields(out)["observation_token_ids"] == [7, 8, 9]
        assert tools.run_tool({**c, "tool": "spy"})  # an earlier version's plain job runs too
    finally:
        tools.use_registry(tools.load_registry(None))
    with pytest.raises(ValueError, match="history_token_ids"):
        tools.unpack_token_fields({"history_token_ids": "not packed!"})


def test_a_job_stores_its_payload_once_and_describes_itself_in_a_line(redis_url, namespace,
                                                                     redis_client):
    """RQ's default description is the call's repr: the whole conversation a second time in the
    job, built by the GPU worker and sent back and forth with it. Ours names the call."""
    from rq.job import Job

    from workers import tools

    c = call("sim", turn=1).model_dump()
    c["history_token_ids"] = list(range(0, 2_000_000, 401))
    ex = RqExecutor(redis_url, namespace)
    try:
        job_id = ex._enqueue(ex._tools_queue, "tool sim", tools.run_tool, c)
        job = Job.fetch(job_id, connection=redis_client, serializer=ex._serializer)
        assert job.description == "tool sim, session s1, turn 1"
        stored = redis_client.hgetall(Job.key_for(job_id))
        payload = len(stored[b"data"])
        assert sum(len(v) for k, v in stored.items() if k != b"data") < payload / 4
    finally:
        tools.purge_tool_queues(redis_client, namespace)
        asyncio.run(ex.aclose())


def test_a_tool_worker_takes_10_round_trips_a_job(redis_url, namespace, monkeypatch):
    """RQ's SimpleWorker takes 21 round trips to Redis per job (heartbeats as three single
    commands, three a job; the state written twice; a suspension check before each); the tool
    worker takes 10."""
    import redis.connection

    from workers.tools import load_registry, run_tool, run_tool_worker

    ex = RqExecutor(redis_url, namespace, timeout_s=10.0)
    sends = {"n": 0}
    real = redis.connection.AbstractConnection.send_packed_command

    def counting(self, *args, **kwargs):
        sends["n"] += 1
        return real(self, *args, **kwargs)

    def burst(jobs: int) -> int:
        for _ in range(jobs):
            ex._enqueue(ex._tools_queue, "tool sim", run_tool, call("sim").model_dump())
        sends["n"] = 0
        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)
        try:
            run_tool_worker(redis_url, load_registry(None), namespace, burst=True)
        finally:
            monkeypatch.undo()
        return sends["n"]

    try:
        fixed = burst(0)  # start-up, registration, the burst's last empty look, the stop
        per_job = (burst(40) - fixed) / 40
    finally:
        asyncio.run(ex.aclose())
    assert per_job <= 10.5, per_job


def test_a_suspended_tool_worker_takes_no_job(redis_url, namespace, redis_client):
    """`rq suspend` still holds tool workers back, though they look it up at most once a
    second: a job enqueued while suspended stays queued, and runs after `rq resume`."""
    from rq import Queue
    from rq.serializers import JSONSerializer
    from rq.suspension import resume, suspend

    from workers.tools import load_registry, run_tool, run_tool_worker

    ex = RqExecutor(redis_url, namespace, timeout_s=10.0)
    queue = Queue(ex._tools_queue, connection=redis_client, serializer=JSONSerializer)
    try:
        job_id = ex._enqueue(ex._tools_queue, "tool sim", run_tool, call("sim").model_dump())
        suspend(redis_client)
        try:
            run_tool_worker(redis_url, load_registry(None), namespace, burst=True)
            assert queue.get_job_ids() == [job_id]
        finally:
            resume(redis_client)
        run_tool_worker(redis_url, load_registry(None), namespace, burst=True)
        assert queue.get_job_ids() == []
        assert redis_client.llen(ex._replies) == 1
    finally:
        asyncio.run(ex.aclose())


def test_purge_leaves_nothing_of_the_namespace_tool_queues(redis_url, namespace, redis_client):
    from rq import Queue
    from rq.serializers import JSONSerializer

    from workers.tools import load_registry, purge_tool_queues, run_tool, run_tool_worker

    ex = RqExecutor(redis_url, namespace, timeout_s=10.0)
    other = RqExecutor(redis_url, namespace + "x", timeout_s=10.0)  # must survive the purge
    try:
        done = [ex._enqueue(ex._tools_queue, "tool sim", run_tool, call("sim").model_dump())
                for _ in range(5)]
        run_tool_worker(redis_url, load_registry(None), namespace, burst=True)  # 5 finished
        queued = [ex._enqueue(q, "tool sim", run_tool, call("sim").model_dump())
                  for q in (ex._tools_queue, ex._rewards_queue)]
        kept = other._enqueue(other._tools_queue, "tool sim", run_tool, call("sim").model_dump())
        assert redis_client.llen(ex._replies) == 5
        assert purge_tool_queues(redis_client, namespace) == 7
        for job_id in done + queued:
            assert not redis_client.exists(f"rq:job:{job_id}", f"rq:results:{job_id}")
        left = [k for pattern in (f"rq:*rb:{{{namespace}}}:*", f"rb:{{{namespace}}}:tool*")
                for k in redis_client.scan_iter(match=pattern, count=1000)]
        assert left == []
        q = Queue(other._tools_queue, connection=redis_client, serializer=JSONSerializer)
        assert q.get_job_ids() == [kept]
    finally:
        purge_tool_queues(redis_client, namespace + "x")
        asyncio.run(ex.aclose())
        asyncio.run(other.aclose())


def test_a_stop_that_lands_just_as_a_job_is_taken_runs_the_job_first(redis_url, namespace,
                                                                      redis_client):
    """RQ takes a job off the queue with BLPOP while the worker is idle, and its SIGTERM handler
    raises when the worker is idle: a stop landing between the pop and the job's start lost the
    job (in no queue or registry; its caller waited out its deadline). Made certain here: the
    child sends itself SIGTERM right after the pop. The job must run, and the worker exit."""
    from rq.job import Job, JobStatus
    from rq.serializers import JSONSerializer

    from workers.tools import run_tool

    ex = RqExecutor(redis_url, namespace, timeout_s=10.0)
    try:
        job_id = ex._enqueue(ex._tools_queue, "tool sim", run_tool, call("sim").model_dump())
    finally:
        asyncio.run(ex.aclose())
    child = (
        "import os, signal, sys\n"
        "import rq.queue\n"
        "take = rq.queue.Queue.dequeue_any.__func__\n"
        "def dequeue_any(cls, *args, **kwargs):\n"
        "    found = take(cls, *args, **kwargs)\n"
        "    if found is not None:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return found\n"
        "rq.queue.Queue.dequeue_any = classmethod(dequeue_any)\n"
        "from rollout_broker.cli import app\n"
        "sys.argv = ['rollout-broker', 'tools', '--redis-url', sys.argv[1], '--namespace', sys.argv[2]]\n"
        "app()\n"
    )
    p = subprocess.run([sys.executable, "-c", child, redis_url, namespace], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    job = Job.fetch(job_id, connection=redis_client, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.FINISHED, (job.get_status(), p.stderr[-2000:])


def test_an_idle_tool_worker_stops_at_once_even_when_its_rq_listener_saw_the_unsubscribe(
        redis_url, namespace):
    """RQ's teardown unsubscribes its command listener and then stops its thread; a thread that
    read the unsubscribe first waited for a message again, and redis-py's stop() waits for the
    thread: the worker took the listener's whole wait (60 s in RQ) to exit. Made certain here:
    the child pauses after sending the unsubscribe, so its listener is waiting again when stop
    comes. SIGTERM at 1 s; the worker must be gone well before 60 s."""
    child = (
        "import os, signal, sys, threading, time\n"
        "import redis.client\n"
        "send = redis.client.PubSub.unsubscribe\n"
        "def unsubscribe(self, *args):\n"
        "    out = send(self, *args)\n"
        "    time.sleep(0.5)  # the listener reads the reply and waits again meanwhile\n"
        "    return out\n"
        "redis.client.PubSub.unsubscribe = unsubscribe\n"
        "threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()\n"
        "from rollout_broker.cli import app\n"
        "sys.argv = ['rollout-broker', 'tools', '--redis-url', sys.argv[1], '--namespace', sys.argv[2]]\n"
        "app()\n"
    )
    started = time.monotonic()
    p = subprocess.run([sys.executable, "-c", child, redis_url, namespace], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                       text=True, timeout=80)
    took = time.monotonic() - started
    assert p.returncode == 0, p.stderr[-2000:]
    assert took < 30, f"the tool worker took {took:.1f}s to stop"


def test_a_result_pushed_while_the_poller_asks_leaves_the_poller_running(redis_url, namespace):
    """The listener hands a pushed result to its call (and forgets the job) while the poller
    is asking Redis about the jobs it listed; before, the poller then looked the job up, died
    on a KeyError, and its other jobs waited for a call that would start it again (seen in a
    CI run's demo log: 'Task exception was never retrieved ... KeyError')."""
    async def main() -> None:
        ex = RqExecutor(redis_url, namespace, timeout_s=30.0, poll_s=0.01)
        loop = asyncio.get_running_loop()
        pushed, waits = loop.create_future(), loop.create_future()
        ex._waiting = {"a": (pushed, "tool sim", time.monotonic() + 30),
                       "b": (waits, "tool sim", time.monotonic() + 30)}
        asked = 0

        def statuses(ids):  # "a"'s result arrives on the listener meanwhile
            nonlocal asked
            asked += 1
            entry = ex._waiting.pop("a", None)
            if entry is not None:
                loop.call_soon_threadsafe(entry[0].set_result, "done")
            return {}

        ex._statuses = statuses
        poller = asyncio.create_task(ex._poll())
        while asked < 3 and not poller.done():
            await asyncio.sleep(0.01)
        assert not poller.done(), poller.exception()
        assert await pushed == "done" and not waits.done()
        poller.cancel()
        await ex.aclose()

    asyncio.run(main())
