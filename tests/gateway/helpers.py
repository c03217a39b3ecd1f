"""A small fleet for gateway tests: simulated engines (with their request journals), one worker
each, the broker, the gateway, and the trainer's client, on the test's Redis namespace."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import httpx

from broker.client import RolloutClient
from broker.policies import make_policy
from broker.session import SessionResult
from gateway.testing import RunningGateway, running_gateway
from sim.server.testing import RunningEngine, running_engine
from tests.broker.helpers import BrokerThread, wait_until
from tests.workers.helpers import WorkerThread


@dataclass
class Fleet:
    client: RolloutClient
    gateway: RunningGateway
    engines: dict[str, RunningEngine]
    workers: dict[str, WorkerThread]
    broker: BrokerThread | None
    stops: dict[str, ExitStack]

    def stop_backend(self, backend_id: str) -> None:
        """Its worker stops (withdrawing its sessions), then its engine goes away."""
        self.workers[backend_id].stop()
        self.stops[backend_id].close()

    def open(self, episode_id: str, **spec) -> str:
        return self.client.open_episode({"session_id": episode_id, "workload": "agentic",
                                         **spec}, self.gateway.url)


@contextmanager
def fleet(redis_url: str, namespace: str, engines: int = 1, policy: str = "misa_t",
          kv_tokens: int = 60_000, broker: bool = True, time_scale: float = 200.0,
          **gateway_settings) -> Iterator[Fleet]:
    with ExitStack() as stack:
        stops = {f"w{i}": stack.enter_context(ExitStack()) for i in range(engines)}
        running = {b: s.enter_context(running_engine(time_scale=time_scale, kv_tokens=kv_tokens,
                                                     journal=4096))
                   for b, s in stops.items()}
        workers = {b: WorkerThread(redis_url, namespace, b, e.url).start()
                   for b, e in running.items()}
        stack.callback(lambda: [w.stop() for w in workers.values()])
        client = RolloutClient(redis_url, namespace)
        stack.callback(client.close)
        assert wait_until(lambda: all(client.status()["backends"].get(b, {}).get("healthy")
                                      for b in running), timeout=30)
        thread = None
        if broker:
            thread = BrokerThread(redis_url, namespace, make_policy(policy)).start()
            stack.callback(thread.stop)
        gw = stack.enter_context(running_gateway(redis_url, namespace, **gateway_settings))
        yield Fleet(client, gw, running, workers, thread, stops)


def journal(engine: RunningEngine) -> list[dict]:
    return httpx.get(f"{engine.url}/sim/journal", timeout=10).json()


def engine_view(f: Fleet, episode_id: str, engines: list[str] | None = None) -> list[dict]:
    """The engines' own records of an episode's requests, in the order they were sent."""
    out = []
    for b in engines or list(f.engines):
        out += [r for r in journal(f.engines[b]) if r["request_id"].startswith(f"{episode_id}-t")]
    return sorted(out, key=lambda r: _order(r["request_id"], episode_id))


def _order(request_id: str, episode_id: str) -> tuple[int, int]:
    tail = request_id[len(f"{episode_id}-t"):]
    turn, _, piece = tail.partition("-p")
    return int(turn), int(piece or 0)


def check_token_exact(result: SessionResult, requests: list[dict]) -> None:
    """The result's tokens are what the engines consumed and produced: each request's prompt is
    the trajectory up to it, its output the record's output; the loss mask is 1 exactly on
    the outputs; one logprob per model token."""
    traj = result.trajectory()
    assert len(requests) == len(result.turn_records)
    at = 0
    for rec, req in zip(result.turn_records, requests):
        at += len(rec.input_token_ids)
        assert req["prompt_token_ids"] == traj.token_ids[:at]
        assert req["output_token_ids"] == rec.output_token_ids
        assert rec.output_logprobs is not None
        assert len(rec.output_logprobs) == len(rec.output_token_ids)
        assert traj.loss_mask[at:at + len(rec.output_token_ids)] == [1] * len(rec.output_token_ids)
        at += len(rec.output_token_ids)
    assert at == len(traj.token_ids)
    assert sum(traj.loss_mask) == sum(len(r.output_token_ids) for r in result.turn_records)
