"""examples/agent_gateway.py (README: Bring your own agent) against a live fleet: the plain-openai
calculator agent calls tools through the gateway, and the GRPO loop trains on whole groups of
token-exact trajectories across weight updates."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.gateway.helpers import check_token_exact, engine_view, fleet
from tests.scripts import load_script

pytestmark = pytest.mark.timeout(180)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent_gateway.py"


def test_the_agent_example_trains_through_the_gateway(redis_url, namespace):
    example = load_script(EXAMPLE)
    with fleet(redis_url, namespace, engines=2) as f:
        trained = asyncio.run(example.run(redis_url, namespace, f.gateway.url, steps=2,
                                          simulated=True, seed=3))
        assert f.client.weights().version == 2
    groups = {r.group_id: [] for m in trained for r in m}
    for m in trained:
        groups[m[0].group_id] += m
    assert len(groups) == 2 * example.GROUPS
    assert all(len(m) == example.GROUP for m in groups.values())
    results = [r for m in trained for r in m]
    # The simulated model called the calculator on every turn but its last, as told.
    multi = [r for r in results if r.turns > 1]
    assert multi
    for r in results:
        assert r.reward is not None
        assert [t.policy_version for t in r.turn_records] == [r.policy_version] * len(r.turn_records)


def test_every_call_of_the_example_is_token_exact(redis_url, namespace):
    example = load_script(EXAMPLE)
    with fleet(redis_url, namespace, engines=2) as f:
        trained = asyncio.run(example.run(redis_url, namespace, f.gateway.url, steps=1,
                                          simulated=True, seed=4))
        for r in (r for m in trained for r in m):
            check_token_exact(r, engine_view(f, r.session_id))
