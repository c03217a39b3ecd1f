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


def test_the_readme_shows_the_tested_loop_line_for_line():
    """The README's training loop is a contiguous part of examples/async_grpo.py, which the
    test above runs: an edit to one that is not made to the other fails here."""
    readme = (EXAMPLE.parents[1] / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in readme.split("```python\n")[1:]]
    loops = [b.splitlines() for b in blocks if "async def run(" in b]
    assert len(loops) == 1, "the README shows one async GRPO loop"
    loop, example = loops[0], EXAMPLE.read_text().splitlines()
    assert len(loop) >= 40
    starts = [i for i, line in enumerate(example) if line == loop[0]]
    assert any(example[i:i + len(loop)] == loop for i in starts), \
        "the README's loop is not a part of examples/async_grpo.py"
