"""Every process rides out a Redis restart by itself: nothing lost, nothing twice, no restarts.

A private Redis with an append-only file (fsync always) that the test kills and starts again
on the same port and data, under a broker, a worker on a simulated engine and a trainer client.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from broker.client import AsyncRolloutClient, RolloutClient
from broker.policies import make_policy
from broker.redis_server import free_port, start_private_redis
from broker.service import BrokerService, BrokerSettings
from broker.session import Session, SessionState
from sim.server.testing import running_engine
from tests.broker.helpers import BrokerThread, wait_until
from tests.workers.helpers import WorkerThread, prompt

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]


class RestartableRedis:
    def __init__(self, workdir: str) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.handle = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.handle = start_private_redis(appendonly=True, port=self.port, workdir=self.workdir,
                                          extra_args=("--appendfsync", "always"))

    def kill(self) -> None:
        self.handle.process.kill()
        self.handle.process.wait()

    def close(self) -> None:
        self.handle.close()


@pytest.fixture
def own_redis(tmp_path):
    r = RestartableRedis(str(tmp_path))
    yield r
    r.close()


def sessions(n: int) -> list[Session]:
    out = []
    for i in range(n):
        if i % 3 == 2:  # agentic: a tool call between turns keeps some running across the outage
            out.append(Session(session_id=f"a{i}", workload="agentic",
                               prompt_token_ids=prompt(i, 120), max_tokens=16, max_turns=2,
                               metadata={"tool": "sim", "sim_turns": 2,
                                         "sim_tool_latency_s": "300",
                                         "sim_observation_tokens": "8"}))
        else:
            out.append(Session(session_id=f"s{i}", workload="rlvr" if i % 3 else "rlhf",
                               prompt_token_ids=prompt(i, 64), max_tokens=16))
    return out


def test_broker_worker_and_client_ride_out_a_redis_kill_and_restart(own_redis):
    batch = sessions(60)
    got = []
    with running_engine(time_scale=200.0, kv_tokens=60_000) as engine:
        worker = WorkerThread(own_redis.url, "ns", "w0", engine.url).start()
        broker = BrokerThread(own_redis.url, "ns", make_policy("least_loaded"), lease_s=2.0).start()
        client = RolloutClient(own_redis.url, "ns")
        try:
            assert wait_until(lambda: client.status()["backends"].get("w0", {}).get("healthy"),
                              timeout=30)
            client.enqueue(batch)
            assert wait_until(lambda: got.extend(client.results(100, timeout=0.2)) or
                              len(got) >= 10, timeout=30, every=0)
            own_redis.kill()
            down_at = time.monotonic()
            while time.monotonic() - down_at < 4.0:  # the trainer keeps asking meanwhile
                got.extend(client.results(100, timeout=0.5))
            own_redis.start()
            assert wait_until(lambda: got.extend(client.results(100, timeout=0.2)) or
                              len(got) >= len(batch), timeout=90, every=0), len(got)
            client.ack()
            assert broker.thread.is_alive() and worker.thread.is_alive()
        finally:
            broker.stop()
            worker.stop()
            client.close()
    ids = [r.session_id for r in got]
    assert sorted(ids) == sorted(s.session_id for s in batch)  # each exactly once
    assert all(r.status == SessionState.done for r in got), [r.error for r in got if r.error]


def test_the_async_client_rides_out_a_redis_kill_and_restart(own_redis):
    """The asyncio client, on its own connection: results keep flowing after the restart, each
    exactly once, and while Redis is down its waits hold no thread and block no other
    coroutine (a ticker keeps ticking)."""
    batch = sessions(30)
    handed_to_threads: list[object] = []

    class CountingExecutor(ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):
            handed_to_threads.append(fn)
            return super().submit(fn, *args, **kwargs)

    async def trainer() -> tuple[list, int]:
        asyncio.get_running_loop().set_default_executor(CountingExecutor(max_workers=1))
        got: list = []
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        async with AsyncRolloutClient(own_redis.url, "ns") as client:
            tick = asyncio.create_task(ticker())
            await client.enqueue(batch)
            while len(got) < 5:
                got += await client.results(100, timeout=0.2)
            own_redis.kill()
            ticks_at_kill, down_at = ticks, time.monotonic()
            while time.monotonic() - down_at < 3.0:  # the trainer keeps asking meanwhile
                got += await client.results(100, timeout=0.5)
            ticks_down = ticks - ticks_at_kill
            own_redis.start()
            deadline = time.monotonic() + 90
            while len(got) < len(batch) and time.monotonic() < deadline:
                got += await client.results(100, timeout=0.2)
            tick.cancel()
        return got, ticks_down

    with running_engine(time_scale=200.0, kv_tokens=60_000) as engine:
        worker = WorkerThread(own_redis.url, "ns", "w0", engine.url).start()
        broker = BrokerThread(own_redis.url, "ns", make_policy("least_loaded"), lease_s=2.0).start()
        try:
            got, ticks_down = asyncio.run(trainer())
        finally:
            broker.stop()
            worker.stop()
    assert sorted(r.session_id for r in got) == sorted(s.session_id for s in batch)
    assert all(r.status == SessionState.done for r in got), [r.error for r in got if r.error]
    assert ticks_down >= 30, ticks_down  # ~60 in 3 s: the event loop never stalled
    assert handed_to_threads == []  # no call ran in a worker thread


def test_a_broker_stopped_while_redis_is_down_exits_cleanly(own_redis):
    service = BrokerService(own_redis.url, "ns", make_policy("least_loaded"),
                            BrokerSettings(lease_period_s=1.0))
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            service.run(stop)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert wait_until(lambda: service.lease.held, timeout=20)
    own_redis.kill()
    time.sleep(1.5)  # the broker is waiting the outage out, not dead
    assert thread.is_alive() and not errors
    stop.set()
    thread.join(timeout=20)
    assert not thread.is_alive() and not errors  # the lease release in `finally` did not raise
