"""SessionRunner against the simulated engine over HTTP (in-process), tools inline."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from broker.session import PartialRollout, SamplingParams, Session, SessionState
from sim.server.testing import running_engine
from workers.engine import read_engine_info
from tests.workers.tools_for_tests import TOOLS_TOML
from workers.runner import (EngineUnavailable, EngineWeights, Outcome, RunnerSettings,
                            SessionRunner)
from workers.tools import InlineExecutor, load_registry

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def engine():
    with running_engine(profile="h100-8b", time_scale=200.0, kv_tokens=200_000) as e:
        yield e


REGISTRY = load_registry(TOOLS_TOML)


def agentic(sid: str, turns: int = 4, **meta) -> Session:
    return Session(session_id=sid, workload="agentic", prompt_token_ids=list(range(1, 400)),
                   max_tokens=32, max_turns=turns,
                   metadata={"tool": "sim", "reward": "parity", "sim_turns": turns,
                             "sim_tool_latency_s": ",".join(["0.5"] * turns), **meta})


async def run(engine_url: str, session: Session, tools=None, **settings):
    info = read_engine_info(engine_url)
    tools = tools or InlineExecutor(timeout_s=5.0, registry=REGISTRY)
    async with httpx.AsyncClient() as http:
        runner = SessionRunner(http, engine_url, info.model, info.max_model_len, tools,
                               RunnerSettings(time_scale=200.0, **settings),
                               vocab_size=info.vocab_size)
        try:
            return await runner.run(session)
        finally:
            await tools.aclose()


def test_multi_turn_history_hits_the_prefix_cache_from_turn_two(engine):
    out = asyncio.run(run(engine.url, agentic("a1", turns=4)))
    r = out.result
    assert r.status == SessionState.done, r.error
    assert r.turns == 4 and len(r.output_token_ids) == 4
    assert r.output_tokens == sum(len(t) for t in r.output_token_ids)
    # turn k+1's prompt is turn k's prompt + output + observation: it grows, and is cached
    prompts = [t.prompt_tokens for t in out.turns]
    assert prompts == sorted(prompts) and prompts[0] == 399
    for t in out.turns[1:]:
        assert t.cached_tokens > 0
        assert t.cached_tokens >= (prompts[0] // 16) * 16
    assert r.cached_tokens == sum(t.cached_tokens for t in out.turns)
    assert r.reward is not None and 0.0 <= r.reward <= 1.0
    assert out.stats.turn_output_tokens == [len(t) for t in r.output_token_ids]
    assert out.stats.tool_wait_s > 0


def test_every_turn_carries_the_sessions_priority_to_an_engine_scheduling_by_it():
    """`SessionRunner.run(priority=...)` (the worker passes its session's admission time in
    ms) reaches the engine's scheduler on every turn's request, through vLLM's `priority`."""
    seen: list[tuple[str, int]] = []
    with running_engine(profile="h100-8b", time_scale=200.0, kv_tokens=200_000,
                        scheduling_policy="priority") as e:
        add = e.core.add_request

        def recording(req):
            seen.append((req.request_id, req.priority))
            add(req)

        e.core.add_request = recording

        async def go():
            info = read_engine_info(e.url)
            tools = InlineExecutor(timeout_s=5.0, registry=REGISTRY)
            async with httpx.AsyncClient() as http:
                runner = SessionRunner(http, e.url, info.model, info.max_model_len, tools,
                                       RunnerSettings(time_scale=200.0),
                                       vocab_size=info.vocab_size)
                try:
                    return await runner.run(agentic("prio", turns=3), priority=1_733_000_000_123)
                finally:
                    await tools.aclose()

        r = asyncio.run(go()).result
    assert r.status == SessionState.done, r.error
    turns = [p for rid, p in seen if "prio" in rid]
    assert len(turns) == 3 and set(turns) == {1_733_000_000_123}


def test_turn_records_hold_the_whole_trajectory_with_a_logprob_per_model_token(engine):
    out = asyncio.run(run(engine.url, agentic("tr1", turns=3, sim_output_tokens="6,8,10")))
    r = out.result
    assert r.status == SessionState.done, r.error
    assert [t.turn for t in r.turn_records] == [0, 1, 2]
    for t in r.turn_records:
        assert t.output_logprobs is not None and len(t.output_logprobs) == len(t.output_token_ids)
        assert all(v <= 0.0 for v in t.output_logprobs)
        assert t.finish_reason == "stop" and t.policy_version == 0
    assert r.turn_records[0].input_token_ids == list(range(1, 400))
    assert all(t.input_token_ids for t in r.turn_records[1:])  # the tool's observations
    traj = r.trajectory()
    # The sequence is what the engine saw: the last turn's prompt, then its output.
    assert len(traj.token_ids) == out.turns[-1].prompt_tokens + 10
    assert sum(traj.loss_mask) == r.output_tokens == 24
    model = [tok for tok, m in zip(traj.token_ids, traj.loss_mask) if m]
    assert model == [tok for ids in r.output_token_ids for tok in ids]
    assert [lp for lp, m in zip(traj.logprobs, traj.loss_mask) if m] == \
        [v for t in r.turn_records for v in t.output_logprobs]
    assert {v for v, m in zip(traj.policy_versions, traj.loss_mask) if not m} == {-1}


def test_sampling_stop_token_ids_end_a_turn_and_logprobs_can_be_left_out(engine):
    first = asyncio.run(run(engine.url, Session(
        session_id="st1", workload="rlvr", prompt_token_ids=list(range(5, 300)), max_tokens=64,
        sampling={"seed": 9, "ignore_eos": True}))).result
    ids = first.turn_records[0].output_token_ids
    stopped = asyncio.run(run(engine.url, Session(
        session_id="st2", workload="rlvr", prompt_token_ids=list(range(5, 300)), max_tokens=64,
        sampling={"seed": 9, "ignore_eos": True, "stop_token_ids": [ids[20]],
                  "logprobs": False}))).result
    rec = stopped.turn_records[0]
    assert rec.output_token_ids == ids[: ids.index(ids[20]) + 1]
    assert rec.finish_reason == "stop" and rec.output_logprobs is None
    assert first.turn_records[0].finish_reason == "length"


def test_sim_output_lengths_from_metadata(engine):
    s = agentic("a2", turns=3, sim_output_tokens="5,7,9")
    r = asyncio.run(run(engine.url, s)).result
    assert [len(t) for t in r.output_token_ids] == [5, 7, 9]
    one = agentic("a2b", turns=3, sim_output_tokens=6)  # a number: the same for every turn
    r = asyncio.run(run(engine.url, one)).result
    assert [len(t) for t in r.output_token_ids] == [6, 6, 6]


def test_a_tool_that_raises_fails_the_session_with_its_reason(engine):
    s = agentic("a3", tool="boom")
    r = asyncio.run(run(engine.url, s)).result
    assert r.status == SessionState.failed
    assert "tool exploded on turn 0" in r.error and r.turns == 1


def test_a_tool_that_times_out_fails_the_session(engine):
    s = agentic("a4", tool="slow")
    r = asyncio.run(run(engine.url, s, tools=InlineExecutor(timeout_s=0.3,
                                                            registry=REGISTRY))).result
    assert r.status == SessionState.failed and "timed out after 0.3s" in r.error


def test_a_scorer_that_raises_fails_the_session(engine):
    s = Session(session_id="r1", workload="rlvr", prompt_token_ids=[1, 2, 3], max_tokens=8,
                metadata={"reward": "bad"})
    r = asyncio.run(run(engine.url, s)).result
    assert r.status == SessionState.failed and "divided by zero" in r.error
    assert r.turns == 1 and r.output_tokens > 0


@pytest.mark.parametrize("meta", [{"tool": "sys.exit"}, {"reward": "builtins.len"},
                                  {"tool": "unknown-tool"}])
def test_a_name_the_operator_did_not_register_fails_only_that_session(engine, meta):
    s = agentic("a5", turns=2, **meta)
    r = asyncio.run(run(engine.url, s)).result
    assert r.status == SessionState.failed
    key = "tool" if "tool" in meta else "reward"
    assert f"{key}: {meta[key]!r} is not registered on this worker" in r.error


@pytest.mark.parametrize("meta", [{"tool": "exits"}, {"reward": "exits"}])
def test_system_exit_in_a_tool_or_scorer_fails_the_session_and_nothing_else(engine, meta):
    s = agentic("a6", turns=2, **meta)
    r = asyncio.run(run(engine.url, s)).result  # would raise SystemExit out of asyncio.run
    assert r.status == SessionState.failed and "raised SystemExit: 3" in r.error


def test_no_reward_named_means_no_reward(engine):
    s = Session(session_id="r2", workload="rlvr", prompt_token_ids=[1, 2, 3], max_tokens=8)
    r = asyncio.run(run(engine.url, s)).result
    assert r.status == SessionState.done and r.reward is None


def test_metadata_that_breaks_the_run_fails_the_session_with_the_reason(engine):
    s = agentic("a7", turns=2, sim_output_tokens="abc")
    r = asyncio.run(run(engine.url, s)).result  # a ValueError deep inside the turn
    assert r.status == SessionState.failed
    assert r.error.startswith("session: ValueError") and "abc" in r.error


def test_a_token_id_outside_the_vocabulary_fails_before_the_engine_is_asked(engine):
    s = Session(session_id="v1", workload="rlvr", prompt_token_ids=[1, 10**7], max_tokens=8)
    r = asyncio.run(run(engine.url, s)).result
    assert r.status == SessionState.failed and r.turns == 0
    assert "token id 10000000 is not below the engine's vocabulary size" in r.error


def test_engine_5xx_is_retried_then_handed_back_with_the_reason():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(503, text="overloaded")

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            runner = SessionRunner(http, "http://engine", "m", 1000, InlineExecutor(),
                                   RunnerSettings(retries=2, backoff_s=0.01))
            s = Session(session_id="x", workload="rlhf", prompt_token_ids=[1], max_tokens=4)
            return await runner.run(s)

    with pytest.raises(EngineUnavailable) as err:  # the engine's fault: run it again elsewhere
        asyncio.run(go())
    assert "HTTP 503" in str(err.value) and "after 3 attempts" in str(err.value)
    assert len(calls) == 3


def test_a_refused_connection_is_the_engines_fault_not_the_sessions():
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            runner = SessionRunner(http, "http://engine", "m", 1000, InlineExecutor(),
                                   RunnerSettings(retries=1, backoff_s=0.01))
            s = Session(session_id="x", workload="rlhf", prompt_token_ids=[1], max_tokens=4)
            return await runner.run(s)

    with pytest.raises(EngineUnavailable, match="connection refused"):
        asyncio.run(go())


def test_engine_4xx_fails_at_once():
    async def go():
        handler = lambda req: httpx.Response(400, text="bad prompt")  # noqa: E731
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            runner = SessionRunner(http, "http://engine", "m", 1000, InlineExecutor(),
                                   RunnerSettings(retries=3, backoff_s=0.01))
            s = Session(session_id="x", workload="rlhf", prompt_token_ids=[1], max_tokens=4)
            return await runner.run(s)

    r = asyncio.run(go()).result
    assert r.status == SessionState.failed and "HTTP 400" in r.error


def test_a_reply_that_arrives_while_the_worker_pauses_with_abort_is_read_after_the_ack():
    """The trainer waits for every worker's pause acknowledgement; replies the pause cut short
    (thousands of tokens with logprobs each) are parsed after it. A `wait` pause holds nothing:
    its requests finish normally and are delivered at once."""
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"ok": 1})

    async def go():
        weights = EngineWeights()
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            runner = SessionRunner(http, "http://engine", "m", 1000, InlineExecutor(),
                                   weights=weights)
            weights.pause(1, "abort")
            reading = asyncio.create_task(runner._post({}))
            await asyncio.sleep(0.05)
            assert not reading.done()
            weights.pause_done()
            assert await asyncio.wait_for(reading, 5) == {"ok": 1}
            weights.resume(1)
            weights.pause(2, "wait")
            assert await asyncio.wait_for(runner._post({}), 5) == {"ok": 1}

    asyncio.run(go())


def test_a_turn_waiting_for_a_resume_is_handed_back_when_the_worker_stops_serving():
    """A worker that stops in a pause (its drain, or a weights hook that failed) wakes the turns
    waiting for the resume: they send nothing to the paused engine and go back to the queue."""
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(500)

    async def go():
        weights = EngineWeights()
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            runner = SessionRunner(http, "http://engine", "m", 1000, InlineExecutor(),
                                   weights=weights)
            weights.pause(1, "keep")
            s = Session(session_id="x", workload="rlhf", prompt_token_ids=[1], max_tokens=4)
            running = asyncio.create_task(runner.run(s))
            await asyncio.sleep(0.05)
            assert not running.done()  # waiting for the resume
            weights.stop_serving()
            return await asyncio.wait_for(running, 5)

    with pytest.raises(EngineUnavailable, match="handed back before it started"):
        asyncio.run(go())
    assert calls == []


def test_engine_info_reads_capacity_and_context(engine):
    info = read_engine_info(engine.url)
    assert info.capacity_tokens == 200_000 // 16 * 16
    assert info.max_model_len > 0 and info.model == engine.model_name
    assert info.vocab_size == 128_256  # the h100-8b profile's (Llama 3), from the model card


def test_a_session_resumed_from_a_checkpoint_ends_as_if_never_stopped(engine):
    """After each turn whose tool answered, the runner offers a checkpoint. A session that
    goes on from one (another worker, after this one died) generates only the turns left
    and ends with the same records as a run that never stopped."""
    session = agentic("cp1", turns=4).model_copy(
        update={"sampling": SamplingParams(seed=5, logprobs=True)})
    seen: list[PartialRollout] = []

    async def keep(partial: PartialRollout) -> None:
        seen.append(partial)

    async def whole() -> Outcome:
        info = read_engine_info(engine.url)
        tools = InlineExecutor(timeout_s=5.0, registry=REGISTRY)
        async with httpx.AsyncClient() as http:
            runner = SessionRunner(http, engine.url, info.model, info.max_model_len, tools,
                                   RunnerSettings(time_scale=200.0), vocab_size=info.vocab_size)
            try:
                return await runner.run(session, checkpoint=keep)
            finally:
                await tools.aclose()

    full = asyncio.run(whole()).result
    assert full.status == SessionState.done, full.error
    assert [p.turn for p in seen] == [1, 2, 3]  # none after the last turn
    assert [len({r.turn for r in p.turn_records}) for p in seen] == [1, 2, 3]
    out = asyncio.run(run(engine.url, session.model_copy(update={"resume_from": seen[1]})))
    assert len(out.turns) == 2  # only turns 2 and 3 ran again
    assert out.result.status == SessionState.done, out.result.error
    assert out.result.turn_records == full.turn_records
    assert out.result.trajectory() == full.trajectory()
