"""The session gateway on real vLLM (CPU build, tiny model): an unmodified `openai` client drives
an episode; the chat template is applied by the engine (`--tokenizer engine`) or by the model's
own tokenizer in the gateway (`--tokenizer <model dir>`), with the same ids; every recorded
output is what the model generates, greedily, from the recorded ids before it (a single wrong
id in the history changes the tiny model's next tokens); and our hermes parser reads model
text as vLLM's own `Hermes2ProToolParser` does."""

from __future__ import annotations

import httpx
import openai
import pytest

from broker.policies import make_policy
from broker.tool_calls import parse_tool_calls
from gateway.testing import running_gateway
from tests.broker.helpers import BrokerThread, wait_until
from tests.vllm.conftest import RealEngine
from tests.workers.helpers import WorkerThread

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.redis,
              pytest.mark.timeout(300)]


def run_episode(redis_url: str, namespace: str, engine: RealEngine, tokenizer: str):
    from broker.client import RolloutClient

    worker = WorkerThread(redis_url, namespace, "v0", engine.url, time_scale=1.0).start()
    broker = BrokerThread(redis_url, namespace, make_policy("misa_t")).start()
    client = RolloutClient(redis_url, namespace)
    try:
        assert wait_until(lambda: client.status()["backends"].get("v0", {}).get("healthy"),
                          timeout=60)
        with running_gateway(redis_url, namespace, tokenizer=tokenizer) as gw:
            base = client.open_episode({"session_id": "ep-real", "workload": "agentic",
                                        "max_tokens": 12, "sampling": {"temperature": 0.0}},
                                       gw.url)
            oa = openai.OpenAI(base_url=base, api_key="-")
            messages: list[dict] = [{"role": "user", "content": "tell me a story"}]
            replies = []
            for follow_up in ("go on", "and then"):
                r = oa.chat.completions.create(model=engine.model, messages=messages)
                replies.append(r)
                messages += [r.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": follow_up}]
            r = oa.chat.completions.create(model=engine.model, messages=messages)
            replies.append(r)
        assert client.close_episode("ep-real", 1.0) == "ok"
        [result] = client.results(1, timeout=30)
        client.ack()
        return result, replies
    finally:
        broker.stop()
        worker.stop()
        client.close()


def test_gateway_on_real_vllm_is_token_exact(redis_url, namespace, vllm_engine):
    result, replies = run_episode(redis_url, namespace, vllm_engine, "engine")
    assert result.turns == 3 and len(result.turn_records) == 3
    traj = result.trajectory()
    at = 0
    for rec, reply in zip(result.turn_records, replies):
        at += len(rec.input_token_ids)
        assert reply.usage.prompt_tokens == at
        assert len(rec.output_logprobs) == len(rec.output_token_ids) > 0
        again = vllm_engine.generate(traj.token_ids[:at], max_tokens=len(rec.output_token_ids),
                                     temperature=0.0)
        assert again["token_ids"] == rec.output_token_ids
        at += len(rec.output_token_ids)
    assert sum(traj.loss_mask) == sum(len(r.output_token_ids) for r in result.turn_records)
    # The first prompt is the engine's own rendering of the first message.
    rendered = httpx.post(f"{vllm_engine.url}/tokenize", timeout=30, json={
        "model": vllm_engine.model, "add_generation_prompt": True,
        "messages": [{"role": "user", "content": "tell me a story"}]}).json()["tokens"]
    assert result.turn_records[0].input_token_ids == rendered


def test_the_models_tokenizer_in_the_gateway_renders_as_the_engine_does(redis_url, namespace,
                                                                          vllm_engine):
    by_engine, _ = run_episode(redis_url, namespace, vllm_engine, "engine")
    by_gateway, _ = run_episode(redis_url, namespace + "-hf", vllm_engine, vllm_engine.model)
    assert [r.input_token_ids for r in by_gateway.turn_records] == \
        [r.input_token_ids for r in by_engine.turn_records]


@pytest.mark.parametrize("text", [
    "no call here",
    'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "2+2"}}\n</tool_call>',
    '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"x": [1, "é"]}}</tool_call>',
    '<tool_call>\n{"name": "calc", "arguments": {"expression": "1"}',  # cut off: not JSON
    '<tool_call>\n{"name": "calc", "arguments": {"e": 1}}',  # unterminated, whole JSON
    '  spaces  <tool_call>{"name": "x", "arguments": 3}</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
])
def test_our_hermes_parser_reads_text_as_vllms(text, vllm_installed):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    class Tok:  # the parser only needs a tokenizer to exist for extract_tool_calls
        def get_vocab(self) -> dict:
            return {"<tool_call>": 1, "</tool_call>": 2}

    theirs = Hermes2ProToolParser(Tok()).extract_tool_calls(
        text, ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}]))
    ours = parse_tool_calls(text)
    assert ours.content == theirs.content
    assert [(c.name, c.arguments) for c in ours.calls] == \
        [(c.function.name, c.function.arguments) for c in theirs.tool_calls]
