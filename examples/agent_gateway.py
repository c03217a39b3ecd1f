"""Bring your own agent: a calculator agent written with the plain `openai` package, trained with
an async GRPO loop through rollout-broker's session gateway. The agent is ordinary code: it
knows nothing of the broker, only the base URL each episode gets.

    rollout-broker gateway --redis-url redis://127.0.0.1:6379/0 --namespace rl   # + broker, workers
    python3 -m examples.agent_gateway --redis-url redis://127.0.0.1:6379/0 --namespace rl \\
        --gateway http://127.0.0.1:8100          # from the repository root

Each step opens GROUPS groups of GROUP episodes on one question (a GRPO group), runs an agent in
each, closes each episode with the agent's reward, trains on the whole groups' token-exact
trajectories (`train_step` stands in for your trainer) and updates the weights between steps.
On simulated engines (`--simulated`), each episode carries the simulated model's truth (its turn
count and output lengths, drawn from scenarios/demo.yaml's agentic workload) so the simulated
model calls the tool on every turn but its last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import uuid
from collections import defaultdict
from pathlib import Path

from openai import AsyncOpenAI

from broker.client import AsyncRolloutClient
from broker.session import SessionResult
from examples.arith_env import evaluate
from examples.async_grpo import train_step  # your trainer's step, as in the README's loop

GROUP, GROUPS = 4, 4
TOOLS = [{"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression (+ - * / and parentheses).",
    "parameters": {"type": "object", "required": ["expression"],
                   "properties": {"expression": {"type": "string",
                                                 "description": "e.g. (17 + 4) * 3"}}}}}]
SYSTEM = ("Solve the problem. Use the calculator tool for arithmetic. When you are done, answer "
          "with the number alone.")


def calculator(arguments: str) -> str:
    """The tool: a number, or the error an agent shows its model."""
    try:
        return repr(evaluate(str(json.loads(arguments)["expression"])))
    except (ValueError, KeyError, TypeError, ZeroDivisionError, SyntaxError) as exc:
        return f"error: {exc}"


async def calculator_agent(base_url: str, question: str, max_turns: int = 8,
                           tool_wait_s: float = 0.0) -> str:
    """The agent: plain chat completions with function calling, the history resent each call
    (as every OpenAI-compatible agent does). Returns its final answer."""
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=8)
    messages: list[dict] = [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": question}]
    try:
        for _ in range(max_turns):
            reply = await client.chat.completions.create(model="policy", messages=messages,
                                                         tools=TOOLS)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return message.content or ""
            for call in message.tool_calls:
                await asyncio.sleep(tool_wait_s)  # a real tool takes its time
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": calculator(call.function.arguments)})
        return ""
    finally:
        await client.close()


def reward(answer: str, expected: float) -> float:
    try:
        return 1.0 if abs(float(answer.strip()) - expected) < 1e-6 else 0.0
    except ValueError:
        return 0.0


def simulated_truth(rng: random.Random) -> dict:
    """What the simulated model will do in one episode (only for `--simulated`): its turns and
    each turn's output length, drawn from the demo scenario's agentic workload."""
    from sim.scenario import load_scenario
    from sim.workloads.generators import generate_group

    demo = Path(__file__).resolve().parents[1] / "scenarios" / "demo.yaml"
    [s] = generate_group(load_scenario(str(demo)), "agentic", rng.randrange(1 << 30))[:1]
    return {"sim_turns": s.truth.turns,
            "sim_output_tokens": ",".join(map(str, s.truth.output_tokens))}


async def run_group(client: AsyncRolloutClient, gateway: str, step: int, g: int,
                    simulated: bool, rng: random.Random) -> None:
    a, b, c = rng.randrange(100), rng.randrange(100), rng.randrange(2, 10)
    question, expected = f"What is ({a} + {b}) * {c}?", float((a + b) * c)
    group = f"s{step}-g{g}-{uuid.uuid4().hex[:6]}"

    async def one(i: int) -> None:
        episode = f"{group}-{i}"
        meta = simulated_truth(rng) if simulated else {}
        base = await client.open_episode({
            "session_id": episode, "workload": "agentic", "group_id": group,
            "group_size": GROUP, "max_tokens": 512, "max_turns": 8, "policy_version": step,
            "metadata": meta}, gateway)
        answer = await calculator_agent(base, question)
        await client.close_episode(episode, reward(answer, expected))

    await asyncio.gather(*(one(i) for i in range(GROUP)))


async def run(redis_url: str, namespace: str, gateway: str, steps: int, simulated: bool,
              seed: int = 0) -> list[list[SessionResult]]:
    rng = random.Random(seed)
    trained: list[list[SessionResult]] = []
    async with AsyncRolloutClient(redis_url, namespace) as client:
        for step in range(steps):
            await asyncio.gather(*(run_group(client, gateway, step, g, simulated, rng)
                                   for g in range(GROUPS)))
            groups: dict[str, list[SessionResult]] = defaultdict(list)
            while len(groups) < GROUPS or any(len(m) < GROUP for m in groups.values()):
                for r in await client.results(GROUP * GROUPS, timeout=5.0, by_group=True):
                    groups[r.group_id].append(r)
            await client.ack()
            batch = list(groups.values())
            await train_step(batch)
            trained += batch
            await client.pause("abort")
            await client.resume(step + 1)  # your weight sync goes between the two
            solved = sum(r.reward == 1.0 for m in batch for r in m)
            print(f"step {step}: {len(batch)} groups, {solved}/{GROUP * GROUPS} solved, "
                  f"{sum(r.output_tokens for m in batch for r in m)} tokens generated")
    return trained


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--namespace", default="rl")
    ap.add_argument("--gateway", default="http://127.0.0.1:8100")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--simulated", action="store_true",
                    help="the engines are simulated: give each episode the model's truth")
    args = ap.parse_args()
    asyncio.run(run(args.redis_url, args.namespace, args.gateway, args.steps, args.simulated))


if __name__ == "__main__":
    main()
