"""LoRA adapters on real vLLM (CPU build, tiny model): two adapters built offline in PEFT's
layout, registered in the namespace, loaded on demand by the worker through vLLM's
`/v1/load_lora_adapter`, and used by sessions: greedy outputs of one prompt differ with the
adapter and repeat with the same one."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from broker.session import Session, SessionState
from tests.vllm.conftest import ENGINE_ARGS, RealEngine, TinyModels, start_engine
from tests.vllm.test_worker import collect, fleet

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.redis,
              pytest.mark.timeout(600)]

LORA_ARGS = ("--enable-lora", "--max-loras", "1", "--max-lora-rank", "8")


@pytest.fixture(scope="module")
def lora_engine(tiny_models: TinyModels, tmp_path_factory) -> Iterator[RealEngine]:
    engine = start_engine(tiny_models.seed0, ENGINE_ARGS + LORA_ARGS,
                          tmp_path_factory.mktemp("logs") / "vllm-lora.log")
    yield engine
    engine.handle.close()


def test_a_session_runs_with_its_adapter_loaded_on_demand(redis_url, namespace, tiny_models,
                                                         lora_engine, tmp_path):
    from workers.tiny_model import build_tiny_lora

    paths = {name: build_tiny_lora(tmp_path / name, tiny_models.seed0, seed=seed)
             for name, seed in (("ad1", 1), ("ad2", 2))}
    prompt = list(range(100, 164))

    def session(sid: str, adapter: str | None) -> Session:
        return Session(session_id=sid, workload="rlhf", prompt_token_ids=prompt, max_tokens=16,
                       adapter=adapter, sampling={"temperature": 0.0, "ignore_eos": True})

    with fleet(redis_url, namespace, lora_engine) as client:
        assert client.status()["backends"]["v0"]["healthy"]
        for name, path in paths.items():
            client.register_adapter(name, str(path))
        batch = [session("base", None), session("ad1-a", "ad1"), session("ad1-b", "ad1"),
                 session("ad2", "ad2")]
        # One at a time: with --max-loras 1 the engine mixes no adapters in a step anyway,
        # and the order makes the last load (ad2) the one /v1/models lists at the end.
        out: dict[str, tuple[int, ...]] = {}
        for s in batch:
            client.enqueue([s])
            (r,) = collect(client, 1)
            assert r.status == SessionState.done, r.error
            assert r.output_tokens == 16
            out[r.session_id] = tuple(r.output_token_ids[0])
        models = {m["id"]: m for m in httpx.get(f"{lora_engine.url}/v1/models").json()["data"]}
    assert out["ad1-a"] == out["ad1-b"]  # greedy, same adapter: the same tokens
    assert len({out["base"], out["ad1-a"], out["ad2"]}) == 3  # each adapter changes the output
    assert models["ad2"]["root"] == str(paths["ad2"])
    assert models["ad2"]["parent"] == str(tiny_models.seed0)
