"""Tool calling in the sim engine: the hermes chat template, the `sim_tool_call` hint in the
engine and on every route that takes it, and chat replies read as vLLM's hermes parser reads
them (`tool_calls`, finish reason "tool_calls", streamed deltas, tool_choice errors)."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from broker.tool_calls import parse_tool_calls, render_tool_call
from sim.engine.core import EngineCore
from sim.engine.profiles import get_profile
from sim.engine.request import EngineRequest, FinishReason
from sim.server.testing import RunningEngine, running_engine
from sim.server.tokenizer import ChatMessage, MessageToolCall, SimTokenizer

PROFILE = "h100-8b"
TOK = SimTokenizer(get_profile(PROFILE).vocab_size)

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string"},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}}}},
]
MESSAGES = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "weather in paris?"}]


@pytest.fixture(scope="module")
def engine() -> Iterator[RunningEngine]:
    with running_engine(profile=PROFILE, time_scale=200.0, seed=5) as eng:
        yield eng


@pytest.fixture(scope="module")
def http(engine: RunningEngine) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def client(engine: RunningEngine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.base_url, api_key="unused", max_retries=0, timeout=30)


def call_tokens(name: str, arguments: dict) -> int:
    """Output tokens of a call and its EOS."""
    return len(TOK.encode(render_tool_call(name, arguments))) + 1


# --- the chat template ------------------------------------------------------------------------


def test_template_lists_tools_in_the_system_block_after_the_clients_system_message() -> None:
    tools = [TOOLS[0]]
    text = TOK.apply_chat_template([ChatMessage("system", "be brief"), ChatMessage("user", "hi")],
                                   tools=tools)
    assert text == (
        "<|im_start|>system\nbe brief\n\n# Tools\n\nYou may call one or more functions to assist "
        "with the user query.\n\nYou are provided with function signatures within <tools></tools>"
        " XML tags:\n<tools>\n" + json.dumps(tools[0], ensure_ascii=False) + "\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
        "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    alone = TOK.apply_chat_template([ChatMessage("user", "hi")], tools=tools)
    assert alone.startswith("<|im_start|>system\n# Tools\n\n")  # no default system prompt


def test_template_renders_calls_and_groups_consecutive_tool_responses() -> None:
    call = MessageToolCall("get_weather", {"city": "paris"})
    messages = [ChatMessage("user", "hi"),
                ChatMessage("assistant", "", (call, MessageToolCall("search", {}))),
                ChatMessage("tool", "sunny"), ChatMessage("tool", "ten results"),
                ChatMessage("assistant", "checking", (call,))]
    text = TOK.apply_chat_template(messages, add_generation_prompt=False)
    assert text == (
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n" + render_tool_call("get_weather", {"city": "paris"}) + "\n"
        + render_tool_call("search", {}) + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n"
        "ten results\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nchecking\n" + render_tool_call("get_weather", {"city": "paris"})
        + "<|im_end|>\n")


CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "weather in paris and rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "paris", "unit": "celsius"}'}},
        {"id": "c2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "rome", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    {"role": "assistant", "content": "paris is sunny, rome rainy"},
    {"role": "user", "content": "thanks"},
]


def test_rendering_a_prefix_of_the_conversation_gives_a_prefix_of_its_tokens(
        http: httpx.Client) -> None:
    """At every message boundary that does not split the run of tool messages, with the tools
    listed: a later turn's prompt extends an earlier turn's tokens."""
    def tokens(messages: list[dict]) -> list[int]:
        resp = http.post("/tokenize", json={"messages": messages, "tools": TOOLS,
                                            "add_generation_prompt": False})
        assert resp.status_code == 200, resp.text
        return resp.json()["tokens"]

    full = tokens(CONVERSATION)
    for k in (1, 2, 3, 5, 6, 7):
        part = tokens(CONVERSATION[:k])
        assert full[: len(part)] == part, k
    text = http.post("/detokenize", json={"tokens": full}).json()["prompt"]
    assert text.count("<tool_response>") == 2 and text.count("<|im_start|>user") == 3


def test_without_tools_the_tokens_are_plain_chatml(http: httpx.Client) -> None:
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    ids = http.post("/tokenize", json={"messages": plain}).json()["tokens"]
    assert ids == TOK.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo"
                             "<|im_end|>\n<|im_start|>assistant\n")


# --- the engine -------------------------------------------------------------------------------

ONE_SEC = dataclasses.replace(get_profile(PROFILE), kv_tokens=16 * 64, t0=1.0, t_seq=0, a=0,
                              b=0, c=0)


def run_one(ending: list[int] | None, max_tokens: int, output_len: int | None
            ) -> EngineRequest:
    core = EngineCore(ONE_SEC)
    req = EngineRequest("r", [7] * 20, max_tokens, output_len=output_len,
                        forced_ending=None if ending is None else (lambda seed: ending))
    core.add_request(req)
    (done,) = core.run_until_idle()
    return done


def test_a_forced_ending_takes_the_last_positions_at_the_same_cost_per_token() -> None:
    ending = [600, 601, 602, TOK.eos_token_id]
    plain, forced = run_one(None, 50, 10), run_one(ending, 50, 10)
    assert forced.output_token_ids == plain.output_token_ids[:6] + ending
    assert (forced.finish_time, forced.finish_reason) == (plain.finish_time, FinishReason.stop)
    assert len(forced.output_logprobs) == 10
    longer = run_one(ending, 50, 2)  # the ending outlasts the length asked for
    assert longer.output_token_ids == ending and longer.finish_reason is FinishReason.stop
    at_cap = run_one(ending, 4, 4)  # EOS as the last allowed token: stopped, not capped
    assert at_cap.output_token_ids == ending and at_cap.finish_reason is FinishReason.stop
    cut = run_one(ending, 3, 10)  # max_tokens cuts it, as a real model's would be
    assert cut.output_token_ids == plain.output_token_ids[:3]
    assert cut.finish_reason is FinishReason.length
    cut_in = run_one(ending, 8, 10)
    assert cut_in.output_token_ids == plain.output_token_ids[:6] + ending[:2]
    assert cut_in.finish_reason is FinishReason.length


# --- chat completions -------------------------------------------------------------------------


def chat(http: httpx.Client, **body: object) -> dict:
    resp = http.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_sim_tool_call_makes_a_chat_reply_call_the_first_tool(http: httpx.Client) -> None:
    out = chat(http, tools=TOOLS, sim_tool_call=True, sim_output_len=5, seed=3,
               return_token_ids=True)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, WEATHER)
    assert choice["message"]["content"] is None  # the call outlasts sim_output_len: no text
    assert out["usage"]["completion_tokens"] == call_tokens("get_weather", arguments)
    assert choice["token_ids"][-1] == TOK.eos_token_id
    again = chat(http, tools=TOOLS, sim_tool_call=True, sim_output_len=5, seed=3)
    assert again["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == \
        call["function"]["arguments"]  # the seed fixes the arguments


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_call_follows_text_when_the_reply_is_longer(http: httpx.Client,
                                                        skip_special_tokens: bool) -> None:
    out = chat(http, tools=TOOLS, sim_tool_call=True, sim_output_len=120, seed=4,
               return_token_ids=True, skip_special_tokens=skip_special_tokens)
    choice = out["choices"][0]
    assert out["usage"]["completion_tokens"] == 120
    assert choice["finish_reason"] == "tool_calls"
    text = TOK.decode(choice["token_ids"][:-1])
    assert parse_tool_calls(text).content == choice["message"]["content"]
    assert choice["message"]["content"] and "<tool_call>" not in choice["message"]["content"]
    # The EOS that ended it is no text of the reply, as in vLLM's detokenizer.
    raw = chat(http, tools=TOOLS, tool_choice="none", sim_tool_call=True, sim_output_len=120,
               seed=4, skip_special_tokens=skip_special_tokens)
    assert raw["choices"][0]["message"]["content"] == text


def test_without_the_hint_a_chat_with_tools_calls_nothing(http: httpx.Client) -> None:
    out = chat(http, tools=TOOLS, sim_output_len=30, seed=3)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["tool_calls"] == []
    assert out["usage"]["completion_tokens"] == 30


def test_a_named_tool_choice_is_the_function_called_and_stops(http: httpx.Client) -> None:
    named = {"type": "function", "function": {"name": "search"}}
    choice = chat(http, tools=TOOLS, tool_choice=named, sim_tool_call=True, seed=1,
                  sim_output_len=50)["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "search"
    assert list(json.loads(call["function"]["arguments"])) == ["query"]  # none required: all
    assert choice["finish_reason"] == "stop"  # OpenAI's reason for a named choice


def test_tool_choice_none_leaves_the_call_as_text(http: httpx.Client) -> None:
    choice = chat(http, tools=TOOLS, tool_choice="none", sim_tool_call=True, sim_output_len=5,
                  seed=3)["choices"][0]
    assert choice["message"]["tool_calls"] == [] and choice["finish_reason"] == "stop"
    assert choice["message"]["content"].startswith("<tool_call>\n{\"name\": \"get_weather\"")


def test_max_tokens_cuts_the_call_and_it_stays_text(http: httpx.Client) -> None:
    choice = chat(http, tools=TOOLS, sim_tool_call=True, sim_output_len=5, seed=3,
                  max_tokens=12)["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["tool_calls"] == []
    assert choice["message"]["content"].startswith("<tool_call>")


def test_openai_client_reads_the_calls_streamed_and_whole(client: openai.OpenAI,
                                                          engine: RunningEngine) -> None:
    kwargs = dict(model=engine.model_name, messages=MESSAGES, tools=TOOLS, seed=9,
                  extra_body={"sim_tool_call": True, "sim_output_len": 90})
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0] for c in chunks if c.choices]
    content = "".join(d.delta.content or "" for d in deltas)
    streamed = [tc for d in deltas for tc in d.delta.tool_calls or ()]
    assert content == whole.message.content and content
    assert len(streamed) == 1 and streamed[0].index == 0 and streamed[0].type == "function"
    assert streamed[0].id.startswith("chatcmpl-tool-")
    assert streamed[0].function.name == whole.message.tool_calls[0].function.name == "get_weather"
    assert streamed[0].function.arguments == whole.message.tool_calls[0].function.arguments
    assert [d.finish_reason for d in deltas][-1] == "tool_calls"
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert not deltas[-1].delta.content and not deltas[-1].delta.tool_calls


@pytest.mark.parametrize("body, words", [
    ({"tool_choice": "required"}, "`tools` must be set"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "`tools` must be set"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "does not match any of the specified `tools`"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "Invalid value for `tool_choice`"),
])
def test_bad_tool_choice_gets_vllms_error_naming_it(http: httpx.Client, body: dict,
                                                   words: str) -> None:
    resp = http.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "tool_choice" and words in err["message"]


def test_bad_arguments_in_an_earlier_call_are_refused(http: httpx.Client) -> None:
    messages = [*MESSAGES, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]
    resp = http.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS})
    assert resp.status_code == 400
    assert "messages.2.tool_calls.0.function.arguments" in resp.json()["error"]["message"]


# --- token ids in, token ids out ----------------------------------------------------------------


def generate(http: httpx.Client, token_ids: list[int], **extra_args: object) -> dict:
    body = {"token_ids": token_ids,
            "sampling_params": {"max_tokens": 1000, "seed": 6, "extra_args": extra_args}}
    resp = http.post("/inference/v1/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def test_generate_calls_a_tool_listed_in_the_rendered_prompt(http: httpx.Client) -> None:
    messages = [*CONVERSATION[:5]]
    prompt = http.post("/tokenize", json={"messages": messages, "tools": TOOLS[::-1]}).json()
    choice = generate(http, prompt["tokens"], sim_tool_call=True, sim_output_len=40)
    ids = choice["token_ids"]
    assert choice["finish_reason"] == "stop" and ids[-1] == TOK.eos_token_id
    parsed = parse_tool_calls(TOK.decode(ids[:-1]))
    (call,) = parsed.calls
    assert call.name == "search"  # the first tool of the prompt's tools block
    assert len(ids) == max(40, call_tokens("search", json.loads(call.arguments)))
    again = generate(http, prompt["tokens"], sim_tool_call=True, sim_output_len=40)
    assert again["token_ids"] == ids
    first = http.post("/tokenize", json={"messages": MESSAGES, "tools": TOOLS}).json()["tokens"]
    both = generate(http, first + prompt["tokens"], sim_tool_call=True, sim_output_len=40)
    assert parse_tool_calls(TOK.decode(both["token_ids"][:-1])).calls[0].name == "search"


def test_generate_ignores_the_hint_without_tools_in_the_prompt(http: httpx.Client) -> None:
    prompt = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    choice = generate(http, prompt, sim_tool_call=True, sim_output_len=40)
    assert len(choice["token_ids"]) == 40 and TOK.eos_token_id not in choice["token_ids"]
    assert "<tool_call>" not in TOK.decode(choice["token_ids"])


def test_render_passes_the_hint_on_to_generate(http: httpx.Client) -> None:
    rendered = http.post("/v1/chat/completions/render",
                         json={"messages": MESSAGES, "tools": TOOLS, "sim_tool_call": True,
                               "sim_output_len": 7}).json()
    assert rendered["sampling_params"]["extra_args"] == {"sim_output_len": 7,
                                                         "sim_tool_call": True}
    choice = generate(http, rendered["token_ids"], **rendered["sampling_params"]["extra_args"])
    assert parse_tool_calls(TOK.decode(choice["token_ids"][:-1])).calls[0].name == "get_weather"


def test_a_non_boolean_hint_is_refused(http: httpx.Client) -> None:
    body = {"token_ids": [5, 6, 7],
            "sampling_params": {"extra_args": {"sim_tool_call": "yes"}}}
    resp = http.post("/inference/v1/generate", json=body)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "sampling_params.extra_args.sim_tool_call"


def test_completions_take_the_hint_for_a_text_prompt(http: httpx.Client) -> None:
    text = TOK.apply_chat_template([ChatMessage("user", "hi")], tools=TOOLS[:1])
    resp = http.post("/v1/completions", json={"prompt": text, "max_tokens": 500, "seed": 2,
                                              "sim_tool_call": True, "sim_output_len": 3})
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert parse_tool_calls(choice["text"]).calls[0].name == "get_weather"


def test_samples_of_one_request_draw_their_own_arguments(http: httpx.Client) -> None:
    out = chat(http, tools=TOOLS, sim_tool_call=True, sim_output_len=5, seed=random.randrange(99),
               n=4)
    drawn = {c["message"]["tool_calls"][0]["function"]["arguments"] for c in out["choices"]}
    assert len(drawn) > 1
