"""`check_rl_endpoints`: an engine missing what the worker calls is refused at start with one line
naming the vLLM release or the setting. The engine here answers as vLLM 0.32.0 does (replies
recorded from it) with one thing taken away per case; tests/vllm runs the real one."""

from __future__ import annotations

import json

import httpx
import pytest

from workers.engine import EngineIncompatible, check_rl_endpoints, model_vocabulary

CPU_CONFIG = ("model='/m', dtype=torch.bfloat16, device_config=cpu, seed=0, "
              "enable_prefix_caching=True, enable_chunked_prefill={chunked}, pooler_config=None")


def vllm_like(*, dev_mode=True, scale_out=True, generate=True, chunked=False,
              rpc=True) -> httpx.Client:
    """An engine that answers as vLLM 0.32.0 with these settings."""
    def handle(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        dev_routes = {"/is_paused", "/weight_info", "/server_info", "/collective_rpc"}
        if path in dev_routes and (not dev_mode or (path == "/collective_rpc" and not rpc)):
            return httpx.Response(404, json={"detail": "Not Found"})
        if path == "/is_paused":
            return httpx.Response(200, json={"is_paused": False})
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": "default"})
        if path == "/collective_rpc":
            return httpx.Response(400, json={"detail": "Missing 'method' in request body"})
        if path == "/server_info":
            return httpx.Response(200, json={"vllm_config": CPU_CONFIG.format(chunked=chunked)})
        if path == "/inference/v1/generate":
            if not generate:
                return httpx.Response(404, json={"detail": "Not Found"})
            if not scale_out:
                return httpx.Response(403, json={"error": {
                    "message": "Scale-out endpoints are disabled. Restart vllm serve with "
                               "--enable-scale-out to enable them.", "code": 403}})
            return httpx.Response(400, json={"error": {
                "message": "max_tokens must be at least 1, got 0.", "param": "max_tokens"}})
        return httpx.Response(404, json={"detail": "Not Found"})

    return httpx.Client(transport=httpx.MockTransport(handle))


def check(client: httpx.Client, version: str = "0.32.0", hook: bool = True) -> None:
    check_rl_endpoints(client, "http://e", version, weight_reload=hook)


def test_an_engine_with_everything_passes():
    check(vllm_like())
    check(vllm_like(rpc=False), hook=False)  # /collective_rpc matters only with a hook


@pytest.mark.parametrize("engine, version, hook, says", [
    (vllm_like(dev_mode=False), "0.32.0", False, "has no GET /is_paused: vLLM mounts it only "
     "with VLLM_SERVER_DEV_MODE=1"),
    (vllm_like(rpc=False), "0.32.0", True, "has no POST /collective_rpc, which the weights "
     "hook reloads weights through"),
    (vllm_like(scale_out=False), "0.32.0", False, "refuses POST /inference/v1/generate: start "
     "it with --enable-scale-out"),
    (vllm_like(generate=False), "0.33.0", False, "has no POST /inference/v1/generate"),
    (vllm_like(chunked=True), "0.32.0+cpu", False, "CPU build with chunked prefill on"),
    (vllm_like(), "0.11.0", False, "(vLLM 0.11.0) is older than vLLM 0.32.0"),
])
def test_what_is_missing_is_named(engine, version, hook, says):
    with pytest.raises(EngineIncompatible, match="engine http://e") as got:
        check(engine, version, hook)
    assert says in str(got.value) and "\n" not in str(got.value)


def test_the_vocabulary_is_the_larger_of_the_models_and_the_tokenizers(tmp_path):
    """As vLLM checks prompt ids: Qwen's embedding is larger than its tokenizer; a tokenizer
    with added tokens past the embedding is the other way round."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    assert model_vocabulary(str(tmp_path)) == 1000
    tokenizer = {"model": {"vocab": {"a": 0, "b": 899}}, "added_tokens": [{"id": 1203}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert model_vocabulary(str(tmp_path)) == 1204
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 1500}}))
    assert model_vocabulary(str(tmp_path)) == 1500
    assert model_vocabulary(str(tmp_path / "missing")) is None
    assert model_vocabulary("no-such-org/no-such-model") is None
