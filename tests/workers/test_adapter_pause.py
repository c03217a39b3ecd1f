"""An adapter-only weight update end to end (broker/weights.py): `pause_adapter` pauses only
the engine that serves the adapter, the other adapter's sessions run on meanwhile, the
adapter's own wait; `resume_adapter` loads its newly registered weights there and its sessions
go on, those frozen by the pause with their whole output. Two simulated engines serving two
models (so each adapter has one home), MISA-T, real Redis."""

from __future__ import annotations

import time

import httpx
import pytest

from broker.client import RolloutClient
from broker.policies import make_policy
from broker.session import Session, SessionState
from sim.server.testing import running_engine
from tests.broker.helpers import BrokerThread, collect, wait_until
from tests.workers.helpers import WorkerThread, prompt

pytestmark = pytest.mark.timeout(120)


def sessions(tag: str, model: str, adapter: str, n: int, max_tokens: int = 32) -> list[Session]:
    return [Session(session_id=f"{tag}-{i}", workload="rlhf", prompt_token_ids=prompt(9, 64),
                    max_tokens=max_tokens, model=model, adapter=adapter,
                    sampling={"seed": 5, "temperature": 1.0, "ignore_eos": True})
            for i in range(n)]


def is_paused(engine) -> bool:
    return httpx.get(f"{engine.url}/is_paused").json()["is_paused"]


def test_an_adapter_update_pauses_only_the_engine_serving_it(redis_url, namespace):
    with running_engine(time_scale=20.0, model_name="m1", max_loras=2) as e1, \
            running_engine(time_scale=20.0, model_name="m2", max_loras=2) as e2:
        workers = [WorkerThread(redis_url, namespace, b, e.url, time_scale=20.0).start()
                   for b, e in (("w1", e1), ("w2", e2))]
        broker = BrokerThread(redis_url, namespace, make_policy("misa_t")).start()
        client = RolloutClient(redis_url, namespace)
        try:
            assert wait_until(lambda: all(client.status()["backends"].get(b, {}).get("healthy")
                                          for b in ("w1", "w2")), timeout=30)
            client.register_adapter("x", "/ckpt/x/v1")
            client.register_adapter("y", "/ckpt/y/v1")
            with pytest.raises(ValueError, match="^adapter: 'z' is not registered"):
                client.pause_adapter("z")
            client.enqueue(sessions("x1", "m1", "x", 1))
            old = tuple(collect(client, 1)[0].output_token_ids[0])

            # Two long x sessions are running when the update starts (`keep`: frozen).
            client.enqueue(sessions("long", "m1", "x", 2, max_tokens=2000))
            assert wait_until(lambda: client.status()["backends"]["w1"]["sessions"] == 2,
                              timeout=20)
            assert client.pause_adapter("x", "keep") == ["w1", "w2"]
            assert is_paused(e1) and not is_paused(e2)  # only x's engine
            client.enqueue(sessions("y", "m2", "y", 3) + sessions("x2", "m1", "x", 2))
            ys = collect(client, 3)  # y runs on meanwhile
            assert sorted(r.session_id for r in ys) == ["y-0", "y-1", "y-2"]
            time.sleep(0.5)
            assert client.results(10, timeout=0.2) == []  # x's sessions wait
            assert client.status()["pending"]["rlhf"] == 2  # the broker holds the new ones

            assert client.register_adapter("x", "/ckpt/x/v2") == 2
            assert client.resume_adapter("x") is True
            assert client.resume_adapter("x") is False  # not paused any more
            rest = collect(client, 4)
            assert not is_paused(e1)
            assert all(r.status == SessionState.done for r in rest), [r.error for r in rest]
            by_tag = {r.session_id.split("-")[0]: r for r in rest}
            assert {r.session_id.split("-")[0] for r in rest} == {"long", "x2"}
            assert all(r.output_tokens == 2000 for r in rest if r.session_id.startswith("long"))
            # The sessions after the update ran on x's new weights, loaded on w1 in place.
            assert tuple(by_tag["x2"].output_token_ids[0]) != old
            assert httpx.get(f"{e1.url}/sim/lora").json()["adapters"]["x"] == "/ckpt/x/v2"
        finally:
            broker.stop()
            for w in workers:
                w.stop()
            client.close()


def test_adapter_pauses_are_recorded_per_adapter(redis_url, namespace):
    """With no worker beating, a pause is acknowledged by nobody and returns at once; the
    namespace's weight state names each paused adapter with its mode and epoch."""
    client = RolloutClient(redis_url, namespace)
    try:
        client.register_adapter("x", "/ckpt/x")
        client.register_adapter("y", "/ckpt/y")
        with pytest.raises(ValueError, match="^mode: must be one of"):
            client.pause_adapter("x", "later")
        with pytest.raises(ValueError, match="^adapter: 'a b' is not an adapter name"):
            client.resume_adapter("a b")
        assert client.pause_adapter("x", "abort") == []
        assert client.pause_adapter("x", "keep") == []  # in force already: unchanged
        assert client.pause_adapter("y") == []
        state = client.weights()
        assert dict(state.paused_adapters) == {"x": ("abort", 1), "y": ("keep", 2)}
        assert state.paused == ""  # the namespace itself generates on
        assert client.resume_adapter("x") is True
        assert dict(client.weights().paused_adapters) == {"y": ("keep", 2)}
    finally:
        client.close()
