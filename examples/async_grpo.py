"""An async GRPO loop on rollout-broker: enqueue groups, train on whole groups with their
logprobs, update the weights between steps without stopping the rollouts for long.

    python3 examples/async_grpo.py --redis-url redis://127.0.0.1:6379/0 --namespace rl

`train_step` and `load_weights` stand in for your trainer (e.g. a policy-gradient step on
`trajectory()` with the group-normalised advantage, and a weight sync into the engines)."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from collections import defaultdict

from broker.client import AsyncRolloutClient
from broker.session import Session, SessionResult

GROUP, GROUPS_PER_STEP = 8, 4


def group(step: int, g: int) -> list[Session]:
    a, b = random.randrange(100), random.randrange(100)  # your task (or its token ids)
    return [Session(session_id=f"s{step}-g{g}-{i}", workload="rlvr", group_id=f"s{step}-g{g}",
                    group_size=GROUP, prompt_text=f"What is {a} + {b}?", max_tokens=256,
                    policy_version=step, metadata={"reward": "parity"}) for i in range(GROUP)]


async def train_step(batch: list[list[SessionResult]]) -> None:
    for members in batch:
        rewards = [r.reward or 0.0 for r in members]
        mean, std = statistics.fmean(rewards), statistics.pstdev(rewards) or 1.0
        for r, reward in zip(members, rewards):
            advantage, t = (reward - mean) / std, r.trajectory()
            _ = (advantage, t.token_ids, t.loss_mask, t.logprobs)  # your loss goes here


async def load_weights(version: int) -> None:
    await asyncio.sleep(0.1)  # your weight sync into the engines


async def run(redis_url: str, namespace: str, steps: int) -> int:
    async with AsyncRolloutClient(redis_url, namespace) as client:
        for g in range(GROUPS_PER_STEP * 2):  # one step ahead: rollouts never wait on training
            await client.enqueue(group(0, g))
        for step in range(steps):
            groups: dict[str, list[SessionResult]] = defaultdict(list)
            while len(groups) < GROUPS_PER_STEP:  # whole groups only, never part of one
                want = GROUP * (GROUPS_PER_STEP - len(groups))
                for r in await client.results(want, timeout=5.0, by_group=True):
                    groups[r.group_id].append(r)
            await client.ack()
            batch = list(groups.values())
            await train_step(batch)
            await client.pause("abort")  # cut requests short; sessions go on after the resume
            await load_weights(step + 1)
            await client.resume(step + 1)
            for g in range(GROUPS_PER_STEP):
                await client.enqueue(group(step + 1, g))
    return steps


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--namespace", default="rl")
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    print(f"trained {asyncio.run(run(a.redis_url, a.namespace, a.steps))} steps")
