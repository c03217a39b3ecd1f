"""Pause and resume on the simulated engine, with vLLM's semantics for RL weight updates.

Nothing here waits on wall time to decide an outcome: a paused engine's clock stands still, so
"still running after a pause" holds however slow the machine is.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from sim.server.testing import RunningEngine, running_engine

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def engine():
    with running_engine(profile="h100-8b", time_scale=5.0, seed=3) as e:
        yield e


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 100_000) for _ in range(64)]


def body(engine: RunningEngine, seed: int, max_tokens: int = 4000) -> dict:
    return {"model": engine.model_name, "prompt": prompt(seed), "max_tokens": max_tokens,
            "ignore_eos": True, "return_token_ids": True}


async def metric(http: httpx.AsyncClient, name: str) -> float:
    text = (await http.get("/metrics")).text
    line = next(x for x in text.splitlines() if x.startswith(name))
    return float(line.split()[-1])


async def generated(http: httpx.AsyncClient) -> float:
    return await metric(http, "vllm:generation_tokens_total")


async def until_decoding(http: httpx.AsyncClient) -> None:
    """Until a request runs, then 0.2 s more: a virtual second (×5) of decoding, whatever the
    machine's load (the engine's clock is the wall clock's)."""
    while await metric(http, "vllm:num_requests_running") < 1:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)


def test_pause_keep_freezes_requests_in_place_and_resume_finishes_them_whole(engine):
    async def scenario():
        async with httpx.AsyncClient(base_url=engine.url, timeout=60) as http:
            # 1,200 tokens take about 1.6 s here: paused 2.5 s, it would have finished unfrozen.
            running = asyncio.create_task(http.post("/v1/completions",
                                                    json=body(engine, 1, 1200)))
            await until_decoding(http)
            assert (await http.post("/pause", params={"mode": "keep"})).json() == \
                {"status": "paused"}
            assert (await http.get("/is_paused")).json() == {"is_paused": True}
            frozen = await generated(http)
            assert 0 < frozen < 1200  # what it had generated when paused
            late = asyncio.create_task(http.post("/v1/completions", json=body(engine, 2, 50)))
            await asyncio.sleep(2.5)
            assert await generated(http) == frozen  # nothing decodes while paused
            assert not running.done() and not late.done()
            assert (await http.post("/resume")).json() == {"status": "resumed"}
            first, second = (await running).json(), (await late).json()
            assert (await http.get("/is_paused")).json() == {"is_paused": False}
            return first, second

    first, second = asyncio.run(scenario())
    assert first["choices"][0]["finish_reason"] == "length"
    assert len(first["choices"][0]["token_ids"]) == 1200  # nothing was lost to the pause
    assert len(second["choices"][0]["token_ids"]) == 50  # held while paused, run on resume


def test_pause_abort_returns_partial_outputs_and_clears_the_prefix_cache(engine):
    async def scenario():
        async with httpx.AsyncClient(base_url=engine.url, timeout=60) as http:
            running = asyncio.create_task(http.post("/v1/completions", json=body(engine, 3)))
            await until_decoding(http)
            await http.post("/pause", params={"mode": "abort"})
            assert running.done()  # pause(abort) returns once every request has ended
            partial = running.result().json()
            await http.post("/resume")
            again = (await http.post("/v1/completions", json=body(engine, 3, 8))).json()
            return partial, again

    partial, again = asyncio.run(scenario())
    choice = partial["choices"][0]
    assert choice["finish_reason"] == "abort"
    assert 0 < len(choice["token_ids"]) < 4000
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # cache was dropped


# 64 prompt tokens: vLLM serves at most the full blocks before the last token from cache (48).
@pytest.mark.parametrize("clear_cache, cached", [(True, 0), (False, 48)])
def test_pause_wait_lets_requests_finish_then_drops_the_cache_unless_asked_not_to(
        engine, clear_cache, cached):
    async def scenario():
        async with httpx.AsyncClient(base_url=engine.url, timeout=60) as http:
            running = asyncio.create_task(http.post("/v1/completions",
                                                    json=body(engine, 4, 300)))
            await until_decoding(http)
            await http.post("/pause", params={"mode": "wait",
                                              "clear_cache": str(clear_cache).lower()})
            # Finished before the pause answered: its reply is on the way (a request still
            # generating would never answer while paused, and this would time out).
            finished = (await asyncio.wait_for(running, timeout=10)).json()
            await http.post("/resume")
            again = (await http.post("/v1/completions", json=body(engine, 4, 8))).json()
            return finished, again

    finished, again = asyncio.run(scenario())
    assert finished["choices"][0]["finish_reason"] == "length"
    assert len(finished["choices"][0]["token_ids"]) == 300
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == cached


def test_pause_with_an_unknown_mode_is_refused_naming_the_field(engine):
    r = httpx.post(f"{engine.url}/pause", params={"mode": "sleep"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
    assert httpx.get(f"{engine.url}/is_paused").json() == {"is_paused": False}


def test_a_request_whose_client_goes_away_is_aborted_in_the_engine(engine):
    """vLLM aborts the requests of a dropped connection; so does the simulator."""
    async def scenario():
        async with httpx.AsyncClient(base_url=engine.url, timeout=60) as http:
            call = asyncio.create_task(http.post("/v1/completions", json=body(engine, 5)))
            await until_decoding(http)
            call.cancel()  # the connection is dropped
            waited = 0.0
            while await metric(http, "vllm:num_requests_running") > 0 and waited < 5:
                await asyncio.sleep(0.05)
                waited += 0.05
            return waited, await generated(http)

    waited, tokens = asyncio.run(scenario())
    assert waited < 1.0
    assert tokens < 4000  # it did not run to the end
