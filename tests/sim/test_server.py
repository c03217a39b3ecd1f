"""The sim engine's HTTP server, through the real `openai` client and plain HTTP.

Every completion here comes from the engine core; prompts are random token ids drawn per test so
no test sees another's prefix-cache entries.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Iterator

import httpx
import openai
import pytest

from sim.engine.profiles import get_profile
from prometheus_client.parser import text_string_to_metric_families

from sim.server.testing import RunningEngine, running_engine

PROFILE = "h100-8b"
BLOCK = 16


@pytest.fixture(scope="module")
def engine() -> Iterator[RunningEngine]:
    with running_engine(profile=PROFILE, time_scale=200.0, seed=7) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine: RunningEngine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.base_url, api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def http(engine: RunningEngine) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.url, timeout=30) as c:
        yield c


def random_prompt(n: int, rng_seed: int) -> list[int]:
    rng = random.Random(rng_seed)
    return [rng.randrange(1000, 100_000) for _ in range(n)]


def scrape(http: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    resp = http.get("/metrics")
    assert resp.status_code == 200
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    return sum(v for (n, lab), v in samples.items()
               if n == name and set(labels.items()) <= set(lab))


# --- generation through the openai client ---------------------------------------------------


def test_openai_completion_text_prompt(client: openai.OpenAI, engine: RunningEngine) -> None:
    resp = client.completions.create(model=engine.model_name, prompt="the cat sat on the mat",
                                     max_tokens=12, extra_body={"sim_output_len": 5})
    assert resp.object == "text_completion" and resp.model == engine.model_name
    assert len(resp.choices) == 1 and resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == 5
    assert resp.usage.prompt_tokens == 6
    assert resp.usage.total_tokens == 11
    assert resp.choices[0].text  # detokenized engine output


def test_openai_chat_completion(client: openai.OpenAI, engine: RunningEngine,
                                http: httpx.Client) -> None:
    messages = [{"role": "system", "content": "you are terse"},
                {"role": "user", "content": "say something"}]
    resp = client.chat.completions.create(model=engine.model_name, messages=messages,
                                          max_tokens=20, extra_body={"sim_output_len": 7,
                                                                     "return_token_ids": True})
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    assert resp.usage.completion_tokens == 7
    extra = resp.model_extra or {}
    rendered = http.post("/v1/chat/completions/render",
                         json={"model": engine.model_name, "messages": messages}).json()
    assert extra["prompt_token_ids"] == rendered["token_ids"]
    assert resp.usage.prompt_tokens == len(rendered["token_ids"])
    token_ids = (choice.model_extra or {})["token_ids"]
    assert len(token_ids) == 7
    assert http.post("/detokenize", json={"tokens": token_ids}).json()["prompt"] == \
        choice.message.content


def test_ignore_eos_generates_exactly_max_tokens(client: openai.OpenAI,
                                                  engine: RunningEngine) -> None:
    resp = client.completions.create(model=engine.model_name, prompt=random_prompt(40, 1),
                                     max_tokens=9, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 9 and resp.choices[0].finish_reason == "length"


def test_max_tokens_caps_sim_output_len(client: openai.OpenAI, engine: RunningEngine) -> None:
    resp = client.completions.create(model=engine.model_name, prompt=random_prompt(20, 2),
                                     max_tokens=4, extra_body={"sim_output_len": 50})
    assert resp.usage.completion_tokens == 4 and resp.choices[0].finish_reason == "length"


@pytest.mark.parametrize("prompt_len, expected_hit", [(100, 96), (64, 48), (16, 0), (17, 16)])
def test_same_token_prompt_twice_hits_full_blocks(client: openai.OpenAI, engine: RunningEngine,
                                                  prompt_len: int, expected_hit: int) -> None:
    """vLLM caps a hit at prompt length − 1, so an exact k·16-token prompt hits (k−1)·16."""
    prompt = random_prompt(prompt_len, 100 + prompt_len)
    kwargs = dict(model=engine.model_name, prompt=prompt, max_tokens=3,
                  extra_body={"sim_output_len": 3})
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == expected_hit
    assert expected_hit == ((prompt_len - 1) // BLOCK) * BLOCK


def test_return_token_ids_and_seeded_n(client: openai.OpenAI, engine: RunningEngine,
                                       http: httpx.Client) -> None:
    prompt = random_prompt(30, 3)
    body = {"model": engine.model_name, "prompt": prompt, "max_tokens": 6, "n": 3, "seed": 11,
            "ignore_eos": True, "return_token_ids": True}
    a = http.post("/v1/completions", json=body).json()
    b = http.post("/v1/completions", json=body).json()
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    ids = [c["token_ids"] for c in a["choices"]]
    assert ids == [c["token_ids"] for c in b["choices"]]  # same seed → same tokens
    assert len({tuple(x) for x in ids}) == 3  # samples differ (seed + i, as vLLM's children)
    assert all(c["prompt_token_ids"] == prompt for c in a["choices"])
    assert a["usage"]["prompt_tokens"] == 30 and a["usage"]["completion_tokens"] == 18


def test_prompt_list_gives_one_choice_per_prompt(http: httpx.Client,
                                                 engine: RunningEngine) -> None:
    body = {"model": engine.model_name, "prompt": [random_prompt(5, 4), random_prompt(7, 5)],
            "max_tokens": 2, "ignore_eos": True}
    out = http.post("/v1/completions", json=body).json()
    assert len(out["choices"]) == 2 and out["usage"]["prompt_tokens"] == 12


def test_streaming_completion_and_chat(client: openai.OpenAI, engine: RunningEngine) -> None:
    chunks = list(client.completions.create(
        model=engine.model_name, prompt=random_prompt(25, 6), max_tokens=8, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    chat = list(client.chat.completions.create(
        model=engine.model_name, messages=[{"role": "user", "content": "stream please"}],
        max_tokens=5, stream=True, extra_body={"ignore_eos": True}))
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chat)


# --- metrics ----------------------------------------------------------------------------------


def test_metrics_counters_agree_with_responses() -> None:
    with running_engine(profile=PROFILE, time_scale=200.0) as eng, \
            httpx.Client(base_url=eng.url, timeout=30) as http:
        client = openai.OpenAI(base_url=eng.base_url, api_key="unused", max_retries=0)
        shared = random_prompt(48, 9)
        usages, reasons = [], []
        for i, extra in enumerate([{"sim_output_len": 4}, {"ignore_eos": True},
                                   {"sim_output_len": 2}]):
            resp = client.completions.create(model=eng.model_name, prompt=shared + [500 + i] * 5,
                                             max_tokens=6, extra_body=extra)
            usages.append(resp.usage)
            reasons.append(resp.choices[0].finish_reason)
        m = scrape(http)
        labels = {"model_name": eng.model_name, "engine": "0"}
        assert metric(m, "vllm:prompt_tokens_total", **labels) == \
            sum(u.prompt_tokens for u in usages)
        assert metric(m, "vllm:generation_tokens_total", **labels) == \
            sum(u.completion_tokens for u in usages)
        hits = sum(u.prompt_tokens_details.cached_tokens for u in usages)
        assert hits == 96  # 2nd and 3rd requests reuse the 48-token shared prefix
        assert metric(m, "vllm:prefix_cache_hits_total", **labels) == hits
        assert metric(m, "vllm:prefix_cache_queries_total", **labels) == \
            sum(u.prompt_tokens for u in usages)
        for reason in ("stop", "length"):
            assert metric(m, "vllm:request_success_total", finished_reason=reason, **labels) == \
                reasons.count(reason)
        assert metric(m, "vllm:num_requests_running", **labels) == 0
        assert metric(m, "vllm:num_requests_waiting", **labels) == 0
        assert metric(m, "vllm:num_preemptions_total", **labels) == 0
        assert 0 <= metric(m, "vllm:kv_cache_usage_perc", **labels) <= 1
        info = [lab for (n, lab) in m if n == "vllm:cache_config_info"]
        assert len(info) == 1
        info_labels = dict(info[0])
        assert info_labels["block_size"] == "16" and info_labels["engine"] == "0"
        assert int(info_labels["num_gpu_blocks"]) == get_profile("h100-8b").kv_tokens // 16


# --- tokenizer and render endpoints -------------------------------------------------------


def test_tokenize_detokenize_round_trip(http: httpx.Client, engine: RunningEngine) -> None:
    text = "Héllo, rollout <|im_start|> world 42!"
    tok = http.post("/tokenize", json={"model": engine.model_name, "prompt": text,
                                       "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 32_768
    assert "<|im_start|>" in tok["token_strs"]
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == text
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"] == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_render_endpoints_render_without_generating(http: httpx.Client,
                                                    engine: RunningEngine) -> None:
    before = metric(scrape(http), "vllm:prompt_tokens_total")
    out = http.post("/v1/completions/render", json={
        "model": engine.model_name, "prompt": ["the cat", "a dog"], "temperature": 0.5,
        "max_tokens": 5}).json()
    assert isinstance(out, list) and len(out) == 2
    for item, text in zip(out, ["the cat", "a dog"]):
        assert item["request_id"].startswith("cmpl-") and item["model"] == engine.model_name
        assert item["token_ids"] == http.post("/tokenize", json={"prompt": text}).json()["tokens"]
        assert item["sampling_params"]["temperature"] == 0.5
        assert item["sampling_params"]["max_tokens"] == 5
    chat = http.post("/v1/chat/completions/render", json={
        "model": engine.model_name, "messages": [{"role": "user", "content": "hi"}]}).json()
    assert isinstance(chat, dict) and chat["token_ids"]
    assert chat["sampling_params"]["max_tokens"] == 32_768 - len(chat["token_ids"])
    assert metric(scrape(http), "vllm:prompt_tokens_total") == before


def test_models_and_health(http: httpx.Client, engine: RunningEngine) -> None:
    assert http.get("/health").status_code == 200
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == \
        [(engine.model_name, 32_768)]


# --- logprobs and stop conditions ---------------------------------------------------------------


def test_completion_logprobs_cover_every_sampled_token_and_repeat(http: httpx.Client,
                                                                 engine: RunningEngine) -> None:
    body = {"model": engine.model_name, "prompt": random_prompt(40, 21), "max_tokens": 30,
            "ignore_eos": True, "seed": 3, "logprobs": 2, "return_token_ids": True,
            "return_tokens_as_token_ids": True}
    first = http.post("/v1/completions", json=body).json()["choices"][0]
    again = http.post("/v1/completions", json=body).json()["choices"][0]
    lp = first["logprobs"]
    assert len(lp["token_logprobs"]) == len(first["token_ids"]) == 30
    assert lp["tokens"] == [f"token_id:{t}" for t in first["token_ids"]]
    assert all(v <= 0.0 for v in lp["token_logprobs"])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    for tok, top, v in zip(lp["tokens"], lp["top_logprobs"], lp["token_logprobs"]):
        assert len(top) == 3 and top[tok] == v  # the sampled token and 2 alternatives
        assert sum(math.exp(x) for x in top.values()) <= 1.0 + 1e-9
    assert again["logprobs"] == lp  # same seed: same tokens, same logprobs
    plain = http.post("/v1/completions", json={**body, "logprobs": None}).json()["choices"][0]
    assert plain["logprobs"] is None


@pytest.mark.parametrize("as_ids", [False, True])
def test_completion_logprobs_zero_give_the_sampled_token_alone(http: httpx.Client,
                                                               engine: RunningEngine,
                                                               as_ids: bool) -> None:
    body = {"model": engine.model_name, "prompt": random_prompt(40, 22), "max_tokens": 25,
            "ignore_eos": True, "seed": 4, "return_token_ids": True,
            "return_tokens_as_token_ids": as_ids}
    zero = http.post("/v1/completions", json={**body, "logprobs": 0}).json()["choices"][0]
    two = http.post("/v1/completions", json={**body, "logprobs": 2}).json()["choices"][0]
    lp, lp2 = zero["logprobs"], two["logprobs"]
    assert zero["token_ids"] == two["token_ids"] and zero["text"] == two["text"]
    assert (lp["tokens"], lp["token_logprobs"], lp["text_offset"]) == (
        lp2["tokens"], lp2["token_logprobs"], lp2["text_offset"])
    assert lp["top_logprobs"] == [{t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"])]
    if not as_ids:  # each token's text starts where the previous one's ended
        ends = lp["text_offset"][1:] + [len(zero["text"])]
        assert "".join(zero["text"][a:b] for a, b in zip(lp["text_offset"], ends)) == zero["text"]
        assert lp["tokens"] == [zero["text"][a:b] for a, b in zip(lp["text_offset"], ends)]


def test_chat_logprobs_list_each_token_with_its_top_alternatives(client: openai.OpenAI,
                                                                 engine: RunningEngine) -> None:
    resp = client.chat.completions.create(
        model=engine.model_name, messages=[{"role": "user", "content": "count the sheep"}],
        max_tokens=12, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 12
    assert "".join(c.token for c in content) == resp.choices[0].message.content
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)


def test_stop_token_ids_and_stop_strings_end_the_output_where_vllm_would(
        http: httpx.Client, engine: RunningEngine) -> None:
    base = {"model": engine.model_name, "prompt": random_prompt(40, 22), "max_tokens": 200,
            "ignore_eos": True, "seed": 5, "return_token_ids": True}
    full = http.post("/v1/completions", json=base).json()["choices"][0]
    ids, text = full["token_ids"], full["text"]
    # A stop token id: the output ends with it (vLLM keeps a non-special stop token).
    at = 17
    got = http.post("/v1/completions", json={**base, "stop_token_ids": [ids[at]]}).json()
    choice = got["choices"][0]
    first = ids.index(ids[at])
    assert choice["token_ids"] == ids[: first + 1]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", ids[at])
    assert got["usage"]["completion_tokens"] == first + 1  # the engine generated no more
    # min_tokens holds it back past its first occurrence.
    late = http.post("/v1/completions", json={**base, "stop_token_ids": [ids[at]],
                                               "min_tokens": first + 1}).json()["choices"][0]
    assert len(late["token_ids"]) > first + 1 or late["finish_reason"] == "length"
    # A stop string taken from the middle of the text: cut before it, ended by its last token.
    stop = text[100:106]
    cut = http.post("/v1/completions", json={**base, "stop": [stop]}).json()["choices"][0]
    assert cut["text"] == text[: text.find(stop)]
    assert (cut["finish_reason"], cut["stop_reason"]) == ("stop", stop)
    assert cut["token_ids"] == ids[: len(cut["token_ids"])]
    kept = http.post("/v1/completions", json={**base, "stop": [stop],
                                              "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == text[: text.find(stop) + len(stop)]


# --- errors -----------------------------------------------------------------------------------

MAX_LEN = 32_768


@pytest.mark.parametrize("path, body, status, param, words", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": "lots"}, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens", "at least 1"),
    ("/v1/completions", {"prompt": "", "max_tokens": 3}, 400, "prompt", "non-empty"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", "non-empty"),
    ("/v1/completions", {"prompt": [], "max_tokens": 3}, 400, "prompt", "non-empty"),
    ("/v1/completions", {"prompt": [5, 999_999], "max_tokens": 3}, 400, "prompt", "vocabulary"),
    ("/v1/completions", {"prompt": [5] * 100, "max_tokens": MAX_LEN}, 400, "max_tokens",
     f"maximum context length is {MAX_LEN} tokens. However, you requested {MAX_LEN + 100} "
     f"tokens (100 in the messages, {MAX_LEN} in the completion)"),
    ("/v1/completions", {"prompt": [5] * MAX_LEN, "max_tokens": 1}, 400, "prompt",
     f"maximum context length is {MAX_LEN} tokens. However, your request has {MAX_LEN} input"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", "at least 1"),
    ("/v1/completions", {"model": "gpt-17", "prompt": "hi"}, 404, "model", "`gpt-17` does not"),
    ("/v1/chat/completions", {"max_tokens": 3}, 400, "messages", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 5}],
                              "max_completion_tokens": MAX_LEN}, 400, "max_completion_tokens",
     "in the messages"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
     404, "model", "does not exist"),
    ("/detokenize", {"tokens": [10**7]}, 400, "tokens", "out of vocabulary"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs", "max allowed: 20"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, 400, "logprobs", "non-negative"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, 400, "top_logprobs", "max allowed"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "top_k", "top_k"),
    ("/v1/completions", {"prompt": "hi", "min_p": 1.5}, 400, "min_p", "[0, 1]"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty",
     "greater than zero"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x", ""]}, 400, "stop", "empty string"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": -1}, 400, "min_tokens", "min_tokens"),
])
def test_bad_requests_get_vllm_errors_naming_the_field(http: httpx.Client, path: str, body: dict,
                                                       status: int, param: str,
                                                       words: str) -> None:
    resp = http.post(path, json=body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["code"] == status
    assert err["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert words in err["message"]


def test_openai_client_raises_bad_request(client: openai.OpenAI, engine: RunningEngine) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=engine.model_name, prompt="hi", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"  # type: ignore[index]


# --- KV pressure --------------------------------------------------------------------------


def test_concurrent_requests_on_a_small_kv_cache_preempt_and_all_finish() -> None:
    """32 blocks of KV cannot hold 8 requests growing to 140 tokens: the engine preempts (visible
    in vllm:num_preemptions_total) and still finishes every request with its full output."""
    async def run(eng: RunningEngine) -> list[dict]:
        async with httpx.AsyncClient(base_url=eng.url, timeout=60) as ac:
            bodies = [{"prompt": random_prompt(40, 200 + i), "max_tokens": 100,
                       "ignore_eos": True} for i in range(8)]
            resps = await asyncio.gather(*(ac.post("/v1/completions", json=b) for b in bodies))
            return [r.json() for r in resps]

    # Real time (scale 1): each request lives ~0.6 s, so the 8 overlap however slowly a loaded
    # machine delivers them; at a fast scale they could finish one by one and never contend.
    with running_engine(profile=PROFILE, time_scale=1.0, kv_tokens=512) as eng, \
            httpx.Client(base_url=eng.url, timeout=30) as http:
        assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 31 * BLOCK
        results = asyncio.run(run(eng))
        assert [r["usage"]["completion_tokens"] for r in results] == [100] * 8
        m = scrape(http)
        assert metric(m, "vllm:num_preemptions_total") > 0
        assert metric(m, "vllm:generation_tokens_total") == 800
        assert metric(m, "vllm:num_requests_running") == 0
