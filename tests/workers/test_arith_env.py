"""examples/arith_env.py, a real environment: its functions alone, and a multi-turn session on a
simulated engine through the registry, where the tool reads the engine's text and its
observation text comes back as the engine's tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from broker.session import Session, SessionState
from examples.arith_env import arith_reward, calculator, evaluate
from sim.server.testing import running_engine
from workers.engine import read_engine_info
from workers.runner import RunnerSettings, SessionRunner
from workers.tools import InlineExecutor, load_registry

pytestmark = pytest.mark.timeout(60)

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "arith_tools.toml"


def test_the_calculator_evaluates_only_arithmetic():
    assert evaluate("12*7+3") == 87.0
    assert calculator({"output_text": "First, 12*7+3 then"}) == \
        {"observation_text": "\ncalculator: 12*7+3 = 87\n"}
    assert calculator({"output_text": "__import__('os')"})["observation_text"].startswith(
        "\ncalculator: no expression")
    assert calculator({"output_text": "ANSWER: 87"}) == {"done": True}
    for bad in ("1/0", "2**10", "x+1"):
        with pytest.raises(ValueError):
            evaluate(bad)


def test_the_reward_checks_the_final_answer():
    call = {"output_texts": ["12*7+3", "so the ANSWER: 87"], "metadata": {"answer": 87}}
    assert arith_reward(call) == 1.0
    assert arith_reward({**call, "metadata": {"answer": 86}}) == 0.0
    assert arith_reward({"output_texts": ["no number"], "metadata": {"answer": 1}}) == 0.0


def test_a_session_runs_the_environment_on_an_engine():
    registry = load_registry(str(CONFIG))
    session = Session(session_id="arith-1", workload="agentic",
                      prompt_text="Compute 12*7+3 with the calculator.", max_tokens=24,
                      max_turns=3, sampling={"seed": 1, "ignore_eos": True},
                      metadata={"tool": "calculator", "reward": "arith", "answer": 87})

    async def run():
        with running_engine(profile="h100-8b", time_scale=200.0) as engine:
            info = read_engine_info(engine.url)
            async with httpx.AsyncClient() as http:
                runner = SessionRunner(http, engine.url, info.model, info.max_model_len,
                                       InlineExecutor(timeout_s=10.0, registry=registry),
                                       RunnerSettings(time_scale=200.0),
                                       vocab_size=info.vocab_size)
                result = (await runner.run(session)).result
                texts = [await runner.detokenize(t.output_token_ids)
                         for t in result.turn_records]
                observations = [await runner.detokenize(t.input_token_ids)
                                for t in result.turn_records[1:]]
                return result, texts, observations

    result, texts, observations = asyncio.run(run())
    assert result.status == SessionState.done, result.error
    assert result.turns == 3 and result.reward == 0.0  # random text has no right answer
    # The tool saw each turn's text and its observation text became the next turn's input.
    for text, observation in zip(texts, observations):
        assert observation == calculator({"output_text": text})["observation_text"]
