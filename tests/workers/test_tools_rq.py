"""RqExecutor against a real `rollout-broker tools` worker: results, raised errors, timeouts."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
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
    worker = subprocess.Popen([sys.executable, "-m", "broker.cli", "tools", "--redis-url",
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
    worker = subprocess.Popen([sys.executable, "-m", "broker.cli", "tools", "--redis-url",
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

    assert tool_queues("job-a") == ("rb-job-a-tools", "rb-job-a-rewards")
    with pytest.raises(ValueError, match="namespace"):
        tool_queues("a:b")
    ex = RqExecutor(redis_url, "job-a", timeout_s=1.0)
    try:
        before = redis_client.llen("rq:queue:rb-job-a-tools")
        ex._enqueue("rb-job-a-tools", run_tool, call("sim").model_dump())
        assert redis_client.llen("rq:queue:rb-job-a-tools") == before + 1
        assert not redis_client.exists("rq:queue:rb-job-b-tools")
    finally:
        redis_client.delete("rq:queue:rb-job-a-tools")
        asyncio.run(ex.aclose())
