"""examples/async_grpo.py, the README's training loop, against a live fleet: it trains."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from broker.client import RolloutClient
from broker.policies import make_policy
from sim.server.testing import running_engine
from tests.broker.helpers import BrokerThread, wait_until
from tests.scripts import load_script
from tests.workers.helpers import WorkerThread

pytestmark = pytest.mark.timeout(120)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "async_grpo.py"


def test_the_async_grpo_example_trains_across_weight_updates(redis_url, namespace, redis_client):
    example = load_script(EXAMPLE)
    with running_engine(time_scale=200.0, kv_tokens=60_000) as e0:
        worker = WorkerThread(redis_url, namespace, "w0", e0.url).start()
        broker = BrokerThread(redis_url, namespace, make_policy("misa_t")).start()
        try:
            with RolloutClient(redis_url, namespace) as client:
                assert wait_until(lambda: client.status()["backends"].get("w0", {})
                                  .get("healthy"), timeout=30)
            assert asyncio.run(example.run(redis_url, namespace, steps=3)) == 3
            with RolloutClient(redis_url, namespace) as client:
                assert client.weights().version == 3 and client.weights().paused == ""
        finally:
            broker.stop()
            worker.stop()
