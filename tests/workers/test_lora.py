"""Models and LoRA adapters end to end: broker (MISA-T), three workers on simulated engines
serving two models, one of them with LoRA, real Redis. Sessions name a model and an adapter;
each runs only on an engine serving both, the adapter is loaded on demand through vLLM's API
and its outputs are its own; registering new weights for an adapter changes what it says."""

from __future__ import annotations

import json

import httpx
import pytest

from broker.client import RolloutClient
from broker.policies import make_policy
from broker.session import Session, SessionState
from sim.server.testing import running_engine
from tests.broker.helpers import BrokerThread, collect, wait_until
from tests.workers.helpers import WorkerThread, prompt
from workers.engine import EngineSpec, open_engine, read_engine_info

pytestmark = pytest.mark.timeout(120)

ADAPTERS = ("ad1", "ad2", "ad3", "ad4")  # four adapters, three slots in the fleet


def sessions(tag: str, model: str, adapter: str | None, n: int) -> list[Session]:
    """`n` sessions of the same prompt and sampling seed: one model and adapter, one output."""
    return [Session(session_id=f"{tag}-{i}", workload="rlhf", prompt_token_ids=prompt(3, 64),
                    max_tokens=256, model=model, adapter=adapter,
                    sampling={"seed": 7, "temperature": 1.0, "ignore_eos": True})
            for i in range(n)]


def test_sessions_run_where_their_model_and_adapter_are_served(redis_url, namespace,
                                                               redis_client):
    with running_engine(time_scale=200.0, model_name="m-a") as ea, \
            running_engine(time_scale=200.0, model_name="m-b", max_loras=1) as eb1, \
            running_engine(time_scale=200.0, model_name="m-b", max_loras=2) as eb2:
        engines = {"a0": ea, "b1": eb1, "b2": eb2}
        workers = [WorkerThread(redis_url, namespace, b, e.url).start()
                   for b, e in engines.items()]
        broker = BrokerThread(redis_url, namespace, make_policy("misa_t")).start()
        client = RolloutClient(redis_url, namespace)
        try:
            assert wait_until(lambda: all(client.status()["backends"].get(b, {}).get("healthy")
                                          for b in engines), timeout=30)
            for name in ADAPTERS:
                assert client.register_adapter(name, f"/adapters/{name}/v1") == 1
            assert sorted(client.adapters()) == list(ADAPTERS)

            # What no engine could ever run is refused at enqueue, naming the field.
            with pytest.raises(ValueError, match=r"sessions\[0\]\.adapter: 'nope' is not "
                                                 "registered"):
                client.enqueue(sessions("x", "m-b", "nope", 1))
            with pytest.raises(ValueError, match=r"sessions\[0\]\.model: 'm-z' is served by no "
                                                 "registered backend; served: m-a, m-b"):
                client.enqueue(sessions("x", "m-z", None, 1))

            batch = (sessions("a", "m-a", None, 6) + sessions("b", "m-b", None, 3)
                     + [s for name in ADAPTERS for s in sessions(name, "m-b", name, 4)])
            client.enqueue(batch)
            got = collect(client, len(batch))

            assert sorted(r.session_id for r in got) == sorted(s.session_id for s in batch)
            assert all(r.status == SessionState.done for r in got), \
                [(r.session_id, r.error) for r in got if r.status != SessionState.done]
            by_tag: dict[str, list] = {}
            for r in got:
                by_tag.setdefault(r.session_id.split("-")[0], []).append(r)
            assert {r.backend_id for r in by_tag["a"]} == {"a0"}
            for tag in ("b", *ADAPTERS):
                assert {r.backend_id for r in by_tag[tag]} <= {"b1", "b2"}, tag
            # One prompt, one seed: each adapter (and the base model) says its own thing, the
            # same on whichever engine ran it.
            outputs = {tag: {tuple(r.output_token_ids[0]) for r in rs}
                       for tag, rs in by_tag.items() if tag != "a"}
            assert all(len(o) == 1 for o in outputs.values()), outputs
            assert len({next(iter(o)) for o in outputs.values()}) == 1 + len(ADAPTERS)
            # The engines loaded what ran there, and never held a request for a slot: the
            # broker kept each engine's adapters within its --max-loras (four adapters, three
            # slots: one adapter's sessions waited in the queue, not on an engine).
            stats = {b: httpx.get(f"{e.url}/sim/lora").json() for b, e in engines.items()
                     if b != "a0"}
            ran = {b: {r.session_id.split("-")[0] for rs in by_tag.values() for r in rs
                       if r.backend_id == b} & set(ADAPTERS) for b in stats}
            slots = {"b1": 1, "b2": 2}
            for b, st in stats.items():
                # Each adapter that ran there was loaded; the worker keeps --max-loras of them.
                assert st["loads"] >= len(ran[b]) > 0, (b, st, ran[b])
                assert set(st["adapters"]) <= ran[b] and len(st["adapters"]) <= slots[b]
                assert st["slot_waits"] == 0, (b, st)
            beat = json.loads(redis_client.get(f"rb:{{{namespace}}}:hb:b2"))
            assert set(beat["adapters"]) == set(stats["b2"]["adapters"])

            # New weights for ad1: registered again at a new path, version 2; the next ad1
            # sessions run on them (the engines load them in place).
            assert client.register_adapter("ad1", "/adapters/ad1/v2") == 2
            again = sessions("ad1v2", "m-b", "ad1", 2)
            client.enqueue(again)
            later = collect(client, len(again))
            assert all(r.status == SessionState.done for r in later)
            new = {tuple(r.output_token_ids[0]) for r in later}
            assert len(new) == 1 and new != outputs["ad1"]
            for r in later:
                assert httpx.get(f"{engines[r.backend_id].url}/sim/lora").json()[
                    "adapters"]["ad1"] == "/adapters/ad1/v2"
        finally:
            broker.stop()
            for w in workers:
                w.stop()
            client.close()


def test_an_engine_that_lost_its_adapter_loads_it_again(redis_url, namespace):
    """An engine restarted under its worker has no adapter loaded: the worker's request
    gets a 404, loads the adapter again and the session runs."""
    with running_engine(time_scale=200.0, model_name="m", max_loras=1) as e:
        worker = WorkerThread(redis_url, namespace, "w", e.url).start()
        broker = BrokerThread(redis_url, namespace, make_policy("misa_t")).start()
        client = RolloutClient(redis_url, namespace)
        try:
            assert wait_until(lambda: client.status()["backends"].get("w", {}).get("healthy"),
                              timeout=30)
            client.register_adapter("ad", "/adapters/ad")
            client.enqueue(sessions("first", "m", "ad", 1))
            assert collect(client, 1)[0].status == SessionState.done
            r = httpx.post(f"{e.url}/v1/unload_lora_adapter", json={"lora_name": "ad"})
            assert r.status_code == 200
            client.enqueue(sessions("second", "m", "ad", 1))
            result = collect(client, 1)[0]
            assert result.status == SessionState.done, result.error
            assert httpx.get(f"{e.url}/sim/lora").json()["loads"] == 2
        finally:
            broker.stop()
            worker.stop()
            client.close()


def test_a_sim_engine_spec_passes_its_arguments_and_the_worker_reads_max_loras():
    spec = EngineSpec.parse("sim:h100-8b --max-loras 2")
    assert spec == EngineSpec("sim", "h100-8b", ("--max-loras", "2"))
    handle = open_engine(spec, time_scale=100.0, ready_timeout_s=60)
    try:
        assert read_engine_info(handle.url).max_loras == 2
    finally:
        handle.close()
    with running_engine(time_scale=200.0) as plain:  # LoRA off
        assert read_engine_info(plain.url).max_loras == 0
