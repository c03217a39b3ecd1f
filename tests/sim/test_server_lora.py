"""LoRA on the simulated engine: vLLM's load and unload routes and errors, adapters in
/v1/models and /metrics, outputs that depend on the adapter, and the `max_loras` slots
(sim/engine/adapter_slots.py, the rule the fleet simulator applies too)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sim.engine.adapter_slots import AdapterSlots
from sim.server.testing import RunningEngine, running_engine
from tests.broker.helpers import wait_until


@pytest.fixture(scope="module")
def engine() -> Iterator[RunningEngine]:
    with running_engine(time_scale=200.0, model_name="base", max_loras=1) as e:
        yield e


@pytest.fixture(scope="module")
def http(engine: RunningEngine) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.url, timeout=30) as c:
        yield c


def generate(http: httpx.Client, model: str, n: int = 16) -> httpx.Response:
    return http.post("/inference/v1/generate", json={
        "model": model, "token_ids": list(range(1000, 1064)),
        "sampling_params": {"max_tokens": n, "ignore_eos": True, "seed": 3}})


def test_adapters_load_list_answer_and_unload_as_in_vllm(http):
    assert generate(http, "ad").status_code == 404  # not loaded yet
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "ad", "lora_path": "/p/ad"})
    assert r.status_code == 200 and "added successfully" in r.text
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "ad", "lora_path": "/p/ad"})
    assert again.status_code == 400 and "load_inplace" in again.json()["error"]["message"]
    clash = http.post("/v1/load_lora_adapter", json={"lora_name": "base", "lora_path": "/p"})
    assert clash.status_code == 400 and "conflicts" in clash.json()["error"]["message"]
    cards = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert cards["ad"]["parent"] == "base" and cards["ad"]["root"] == "/p/ad"

    base, lora = generate(http, "base"), generate(http, "ad")
    assert lora.status_code == 200 and lora.json()["model"] == "ad"
    ids = lambda r: r.json()["choices"][0]["token_ids"]  # noqa: E731
    assert ids(base) != ids(lora) and ids(generate(http, "ad")) == ids(lora)
    inplace = http.post("/v1/load_lora_adapter", json={"lora_name": "ad", "lora_path": "/p/ad2",
                                                        "load_inplace": True})
    assert inplace.status_code == 200 and ids(generate(http, "ad")) != ids(lora)  # new weights

    info = [s for f in text_string_to_metric_families(http.get("/metrics").text)
            for s in f.samples if s.name == "vllm:lora_requests_info"]
    assert [s.labels["max_lora"] for s in info] == ["1"]
    config = http.get("/server_info").json()["vllm_config"]
    assert config["lora_config"] == {"max_loras": 1}

    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "ad"}).status_code == 200
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "ad"}).status_code == 404
    assert generate(http, "ad").status_code == 404


def test_a_request_waits_while_other_adapters_hold_every_slot():
    with running_engine(time_scale=5.0, model_name="base", max_loras=1) as e, \
            httpx.Client(base_url=e.url, timeout=60) as http:
        for name in ("x", "y"):
            http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": f"/p/{name}"})
        added = []  # the engine's requests: their virtual arrival and finish times
        add = e.core.add_request

        def recording(req):
            added.append(req)
            add(req)

        e.core.add_request = recording

        def run(name: str, n: int) -> None:
            with httpx.Client(base_url=e.url, timeout=60) as c:
                assert generate(c, name, n=n).status_code == 200

        first = threading.Thread(target=run, args=("x", 1000))  # still running when y comes
        first.start()
        assert wait_until(lambda: running_adapters(http) == "x")
        second = threading.Thread(target=run, args=("y", 1))
        second.start()
        assert wait_until(lambda: http.get("/sim/lora").json()["slot_waits"] == 1)
        first.join()
        second.join()
        x, y = (next(r for r in added if r.max_tokens == n) for n in (1000, 1))
        # y reached the engine only when x's last request had left it (on the engine's own
        # clock: the two clients' wall times race on a busy machine)
        assert y.arrival_time >= x.finish_time


def running_adapters(http: httpx.Client) -> str | None:
    for f in text_string_to_metric_families(http.get("/metrics").text):
        for s in f.samples:
            if s.name == "vllm:lora_requests_info":
                return s.labels["running_lora_adapters"]
    return None


def test_slots_admit_a_running_adapter_and_the_waiting_that_fit():
    slots: AdapterSlots[str] = AdapterSlots(max_loras=2)
    assert slots.submit("a", "a1") and slots.submit("b", "b1") and slots.submit("a", "a2")
    assert not slots.submit("c", "c1") and not slots.submit("d", "d1")
    assert slots.submit("b", "b2")  # b holds a slot: it goes ahead of c and d
    assert slots.release("a") == []  # a still has a2 in the engine
    assert slots.release("a") == ["c1"]  # a's slot frees: the oldest waiting enters
    assert slots.release("b") == [] and slots.release("b") == ["d1"]
    assert slots.running == {"c": 1, "d": 1} and not slots.waiting and slots.slot_waits == 2
