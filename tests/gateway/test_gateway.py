"""The session gateway on simulated engines: an unmodified `openai` client drives episodes; the
results are token-exact against the engines' own journals; retries, bad requests, admission,
idle release and weight updates behave as docs/gateway.md says."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable

import httpx
import openai
import pytest

from broker.keys import Keys
from broker.session import SessionState
from tests.broker.helpers import wait_until
from tests.gateway.helpers import check_token_exact, engine_view, fleet, journal

pytestmark = pytest.mark.timeout(120)

CALC = [{"type": "function", "function": {
    "name": "calc", "description": "evaluate arithmetic",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]


def agent(base_url: str, turns: int, tools: list | None = None,
          before_turn: Callable[[int], None] | None = None) -> list[dict]:
    """An agent as users write one: the plain `openai` client, the history resent each call,
    each tool call answered with a tool message. `before_turn(k)` runs before call k (a test
    holds the agent there)."""
    oa = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=5)
    messages: list[dict] = [{"role": "user", "content": "what is two plus two"}]
    for k in range(turns):
        if before_turn is not None:
            before_turn(k)
        r = oa.chat.completions.create(model="any", messages=messages, tools=tools or openai.NOT_GIVEN)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if msg.tool_calls:
            messages += [{"role": "tool", "tool_call_id": c.id, "content": "4"}
                         for c in msg.tool_calls]
        else:
            messages.append({"role": "user", "content": "and then"})
    oa.close()
    return messages


def test_episode_result_is_token_exact_against_the_engine(redis_url, namespace):
    with fleet(redis_url, namespace) as f:
        base = f.open("ep-1", max_tokens=64, group_id="g1", group_size=1,
                      metadata={"sim_output_tokens": "12,20,9"})
        assert base == f"{f.gateway.url}/sessions/ep-1/v1"
        agent(base, 3)
        assert f.client.close_episode("ep-1", 0.5) == "ok"
        [r] = f.client.results(1, timeout=10)
        f.client.ack()
        assert (r.session_id, r.status, r.reward, r.turns, r.group_id) == \
            ("ep-1", SessionState.done, 0.5, 3, "g1")
        assert [len(t.output_token_ids) for t in r.turn_records] == [12, 20, 9]
        check_token_exact(r, engine_view(f, "ep-1"))
        # Calls 2 and 3 sent the history as ids: only the new messages' tokens are input.
        assert all(0 < len(t.input_token_ids) < 30 for t in r.turn_records[1:])
        assert f.client.close_episode("ep-1", 1.0) == "done"  # closed once only


def test_a_repeated_call_gets_the_recorded_reply_and_runs_nothing(redis_url, namespace):
    with fleet(redis_url, namespace) as f:
        base = f.open("ep-r", max_tokens=16)
        oa = openai.OpenAI(base_url=base, api_key="-")
        msgs = [{"role": "user", "content": "hi"}]
        first = oa.chat.completions.create(model="m", messages=msgs)
        before = len(journal(f.engines["w0"]))
        again = oa.chat.completions.create(model="m", messages=msgs)
        assert again.id == first.id
        assert len(journal(f.engines["w0"])) == before


def test_bad_requests_get_openai_errors_naming_the_field(redis_url, namespace):
    with fleet(redis_url, namespace) as f:
        base = f.open("ep-bad", max_tokens=16)
        oa = openai.OpenAI(base_url=base, api_key="-", max_retries=0)
        for kwargs, param in [
            ({"messages": []}, "messages"),
            ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
            ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
            ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
            ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
             "tool_choice"),
        ]:
            with pytest.raises(openai.BadRequestError) as err:
                oa.chat.completions.create(model="m", **kwargs)
            assert err.value.body["param"] == param, (kwargs, err.value.body)
            assert err.value.body["type"] == "invalid_request_error"
        first = [{"role": "user", "content": "x"}]
        r = oa.chat.completions.create(model="m", messages=first)
        # A later call must resend the history: one that drops it names `messages`.
        with pytest.raises(openai.BadRequestError) as err:
            oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "y"},
                                                             {"role": "user", "content": "z"}])
        assert err.value.body["param"] == "messages"
        assert r.choices[0].message.content is not None
        with pytest.raises(openai.NotFoundError) as err:
            openai.OpenAI(base_url=f"{f.gateway.url}/sessions/nope/v1", api_key="-",
                          max_retries=0).chat.completions.create(model="m", messages=first)
        assert err.value.body["code"] == "episode_not_found"


def test_a_call_not_admitted_in_time_gets_429_with_retry_after(redis_url, namespace):
    with fleet(redis_url, namespace, broker=False, admission_timeout_s=0.5) as f:
        base = f.open("ep-wait", max_tokens=16)
        r = httpx.post(f"{base}/chat/completions", timeout=10,
                       json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 429
        assert r.headers["retry-after"] == "2"
        assert r.json()["error"]["code"] == "admission_pending"
        # Still queued, once: the broker admits it when it runs, and a retry goes through.
        assert f.client.status()["pending"]["agentic"] == 1


def test_an_idle_episode_releases_its_charge_and_is_admitted_again(redis_url, namespace,
                                                                     redis_client):
    k = Keys(namespace)
    with fleet(redis_url, namespace) as f:
        f.client.set_episode_idle_timeout(0.5)
        base = f.open("ep-idle", max_tokens=16)
        oa = openai.OpenAI(base_url=base, api_key="-")
        msgs = [{"role": "user", "content": "x"}]
        r = oa.chat.completions.create(model="m", messages=msgs)
        assert redis_client.hget(k.ledger_sessions("w0"), "ep-idle") is not None
        assert wait_until(lambda: redis_client.hget(k.session("ep-idle"), "state") == b"parked",
                          timeout=10)
        assert redis_client.hget(k.ledger_sessions("w0"), "ep-idle") is None
        assert int(redis_client.hget(k.ledger("w0"), "reserved")) == 0
        msgs += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "y"}]
        oa.chat.completions.create(model="m", messages=msgs)
        assert int(redis_client.hget(k.session("ep-idle"), "releases")) == 1
        assert f.client.close_episode("ep-idle", 1.0) == "ok"
        [res] = f.client.results(1, timeout=10)
        assert res.turns == 2
        check_token_exact(res, engine_view(f, "ep-idle"))


def test_a_busy_episode_keeps_its_charge(redis_url, namespace, redis_client):
    """No release while the agent keeps calling within the timeout."""
    k = Keys(namespace)
    with fleet(redis_url, namespace) as f:
        f.client.set_episode_idle_timeout(1.5)
        base = f.open("ep-busy", max_tokens=8, max_turns=8)
        oa = openai.OpenAI(base_url=base, api_key="-")
        msgs = [{"role": "user", "content": "x"}]
        for _ in range(5):
            r = oa.chat.completions.create(model="m", messages=msgs)
            msgs += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "y"}]
            time.sleep(0.6)
        assert redis_client.hget(k.session("ep-busy"), "releases") is None
        assert redis_client.hget(k.ledger_sessions("w0"), "ep-busy") is not None


def test_async_and_streaming_clients(redis_url, namespace):
    with fleet(redis_url, namespace) as f:
        base = f.open("ep-async", max_tokens=24, metadata={"sim_output_tokens": 10})

        async def run() -> tuple[str, str]:
            oa = openai.AsyncOpenAI(base_url=base, api_key="-")
            msgs = [{"role": "user", "content": "x"}]
            whole = await oa.chat.completions.create(model="m", messages=msgs)
            msgs += [whole.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "y"}]
            parts, finish, usage = [], None, None
            stream = await oa.chat.completions.create(model="m", messages=msgs, stream=True,
                                                      stream_options={"include_usage": True})
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    parts.append(c.delta.content or "")
                    finish = c.finish_reason or finish
            await oa.close()
            assert usage is not None and usage.completion_tokens == 10
            return "".join(parts), finish

        text, finish = asyncio.run(run())
        assert finish == "stop" and text
        # The sync client, streaming, with tools: the tool call arrives as a delta.
        f.open("ep-sync", max_tokens=64, metadata={"sim_output_tokens": 40, "sim_turns": 2})
        oa = openai.OpenAI(base_url=f"{f.gateway.url}/sessions/ep-sync/v1", api_key="-")
        calls, finish = [], None
        for chunk in oa.chat.completions.create(model="m", stream=True, tools=CALC,
                                                messages=[{"role": "user", "content": "2+2"}]):
            for c in chunk.choices:
                calls += c.delta.tool_calls or []
                finish = c.finish_reason or finish
        assert finish == "tool_calls" and calls[0].function.name == "calc"
        assert "expression" in json.loads(calls[0].function.arguments)
        assert f.client.close_episode("ep-async", None) == "ok"
        [res] = f.client.results(1, timeout=10)
        check_token_exact(res, engine_view(f, "ep-async"))


def test_a_pause_holds_a_call_and_abort_continues_it_after_the_resume(redis_url, namespace):
    with fleet(redis_url, namespace, time_scale=10.0) as f:
        base = f.open("ep-pause", max_tokens=4000, metadata={"sim_output_tokens": 2000})
        got: list = []
        t = threading.Thread(target=lambda: got.append(agent(base, 1)))
        t.start()
        assert wait_until(lambda: f.client.status()["backends"]["w0"]["sessions"] == 1,
                          timeout=20)
        time.sleep(0.3)  # the request is generating
        f.client.pause("abort")
        time.sleep(0.5)
        assert t.is_alive()  # held while paused
        f.client.resume(7)
        t.join(timeout=60)
        assert got
        assert f.client.close_episode("ep-pause", 1.0) == "ok"
        [res] = f.client.results(1, timeout=10)
        versions = [rec.policy_version for rec in res.turn_records]
        assert versions[-1] == 7 and len(versions) == 2  # cut by the pause, then version 7
        assert sum(len(x.output_token_ids) for x in res.turn_records) == 2000
        check_token_exact(res, engine_view(f, "ep-pause"))


def test_completions_extend_the_episode_by_text_or_ids(redis_url, namespace):
    with fleet(redis_url, namespace) as f:
        oa = openai.OpenAI(base_url=f.open("ep-text", max_tokens=8), api_key="-", max_retries=0)
        first = oa.completions.create(model="m", prompt="once upon a time")
        text = "once upon a time" + first.choices[0].text + " and then"
        second = oa.completions.create(model="m", prompt=text)
        assert oa.completions.create(model="m", prompt=text).id == second.id  # a retry
        with pytest.raises(openai.BadRequestError) as err:
            oa.completions.create(model="m", prompt="something else entirely, longer than it")
        assert err.value.body["param"] == "prompt"
        assert f.client.close_episode("ep-text", 1.0) == "ok"
        [res] = f.client.results(1, timeout=10)
        check_token_exact(res, engine_view(f, "ep-text"))

        oa = openai.OpenAI(base_url=f.open("ep-ids", max_tokens=8), api_key="-", max_retries=0)
        ids = [300, 301, 302]
        r = oa.completions.create(model="m", prompt=ids)
        history = ids + engine_view(f, "ep-ids")[0]["output_token_ids"]
        oa.completions.create(model="m", prompt=history + [303])
        assert f.client.close_episode("ep-ids", 0.0) == "ok"
        [res] = f.client.results(1, timeout=10)
        assert res.turn_records[1].input_token_ids == [303]
        assert r.choices[0].finish_reason in ("stop", "length")
        check_token_exact(res, engine_view(f, "ep-ids"))


def test_a_cancelled_episode_answers_409_and_publishes_nothing(redis_url, namespace):
    with fleet(redis_url, namespace) as f:
        oa = openai.OpenAI(base_url=f.open("ep-c", max_tokens=8), api_key="-", max_retries=0)
        msgs = [{"role": "user", "content": "x"}]
        r = oa.chat.completions.create(model="m", messages=msgs)
        assert f.client.cancel("ep-c") == "cancelled"
        assert f.client.status()["backends"]["w0"]["reserved_tokens"] == 0
        msgs += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "y"}]
        with pytest.raises(openai.ConflictError) as err:
            oa.chat.completions.create(model="m", messages=msgs)
        assert err.value.body["code"] == "episode_ended"
        assert f.client.close_episode("ep-c", 1.0) == "cancelled"
        assert f.client.results(1, timeout=1) == []


def test_a_close_over_http_may_name_a_registered_reward(redis_url, namespace):
    from workers.tools import BUILTIN_REWARDS, RewardCall

    with fleet(redis_url, namespace) as f:
        base = f.open("ep-rw", max_tokens=8)
        agent(base, 2)
        url = f"{f.gateway.url}/v1/episodes/ep-rw/close"
        bad = httpx.post(url, json={"reward_name": "nope"}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "reward_name"
        both = httpx.post(url, json={"reward": 1.0, "reward_name": "parity"}, timeout=30)
        assert both.status_code == 400
        r = httpx.post(url, json={"reward_name": "parity"}, timeout=30)
        assert r.status_code == 200 and r.json()["outcome"] == "ok"
        [res] = f.client.results(1, timeout=10)
        t = res.trajectory()
        expected = BUILTIN_REWARDS["parity"](RewardCall(
            session_id="ep-rw", workload="agentic", scorer="parity",
            output_token_ids=res.output_token_ids, token_ids=t.token_ids,
            loss_mask=t.loss_mask).model_dump())
        assert res.reward == r.json()["reward"] == expected


def test_a_trainer_over_http_opens_closes_and_reads_results(redis_url, namespace):
    with fleet(redis_url, namespace, token="s3cret") as f:
        auth = {"Authorization": "Bearer s3cret"}
        spec = {"session_id": "ep-h", "workload": "agentic", "max_tokens": 8, "group_id": "g"}
        assert httpx.post(f"{f.gateway.url}/v1/episodes", json=spec, timeout=30).status_code == 401
        r = httpx.post(f"{f.gateway.url}/v1/episodes", json=spec, headers=auth, timeout=30)
        assert r.status_code == 200 and r.json()["base_url"].endswith("/sessions/ep-h/v1")
        bad = httpx.post(f"{f.gateway.url}/v1/episodes", headers=auth, timeout=30,
                         json={**spec, "session_id": "ep-h2", "max_tokens": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        agent(f"{f.gateway.url}/sessions/ep-h/v1", 2)  # the agents' calls need no token
        r = httpx.post(f"{f.gateway.url}/v1/episodes/ep-h/close", json={"reward": 0.25},
                       headers=auth, timeout=30)
        assert r.json() == {"episode_id": "ep-h", "outcome": "ok", "reward": 0.25}
        got = httpx.get(f"{f.gateway.url}/v1/results", params={"count": 4, "timeout": 10},
                        headers=auth, timeout=30).json()["results"]
        assert [(x["session_id"], x["reward"], x["turns"]) for x in got] == [("ep-h", 0.25, 2)]
        again = httpx.get(f"{f.gateway.url}/v1/results", params={"count": 4, "timeout": 0.5},
                          headers=auth, timeout=30).json()["results"]
        assert again == []  # handed over once


def test_an_episode_past_the_staleness_bound_ends_failed_and_its_call_gets_409(redis_url,
                                                                                 namespace):
    with fleet(redis_url, namespace) as f:
        f.client.set_max_staleness(1)
        f.client.resume(5)  # the engines serve version 5; the episode's policy is version 0
        oa = openai.OpenAI(base_url=f.open("ep-old", max_tokens=8, policy_version=0),
                           api_key="-", max_retries=0)
        with pytest.raises(openai.ConflictError) as err:
            oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert err.value.body["code"] == "episode_ended"
        [res] = f.client.results(1, timeout=10)
        assert res.status == SessionState.failed and "stale" in (res.error or "")
