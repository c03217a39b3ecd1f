"""Tool calls and reward scoring for the worker, run inline or as RQ jobs on CPU tool workers.

A tool is a plain function `fn(call: dict) -> dict` taking a `ToolCall` as JSON and returning a
`ToolOutcome` as JSON; a reward scorer is `fn(call: dict) -> float` taking a `RewardCall`. JSON
both ways, so RQ stores them with its JSONSerializer (never pickle). A session picks them by name
in its metadata: `tool` (default `sim`) and `reward` (default `parity`); a name is either one of
`TOOLS` / `SCORERS` or `package.module:function` (the trainer is trusted to name code the tool
workers have installed).

Executors:
- `InlineExecutor` runs the function on a thread of the worker (tests, the demo). A timeout
  abandons the call (a Python thread cannot be killed), so the session fails on time.
- `RqExecutor` enqueues on RQ queues `tools` and `rewards` with RQ's job timeout (the work horse
  is killed), `Retry(max=retries)`, and its failed-job registry keeping what failed for
  `failure_ttl`. CPU tool workers: `rollout-broker tools --redis-url URL`. One poller task per
  executor fetches the status of every job in flight in one round trip per tick.
Both raise `ToolError` with the reason when the call fails or times out.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

TOOLS_QUEUE = "tools"
REWARDS_QUEUE = "rewards"
DEFAULT_VOCAB = 32_000  # below every profile's vocabulary, so simulated ids are valid anywhere

Metadata = dict[str, str | int | float | bool]


class ToolError(RuntimeError):
    """A tool or scorer call that failed or timed out; the message is the session's error."""


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: str
    workload: str
    tool: str
    turn: int = Field(ge=0)  # the turn whose output the tool acts on (0-based)
    max_turns: int = Field(ge=1)
    output_token_ids: list[int]  # that turn's output
    context_tokens: int = Field(ge=0)  # history length so far
    metadata: Metadata = Field(default_factory=dict)
    time_scale: float = Field(default=1.0, gt=0)  # simulated seconds per wall second


class ToolOutcome(BaseModel):
    model_config = ConfigDict(extra="forbid")

    observation_token_ids: list[int]  # appended to the history before the next turn
    done: bool = False  # the episode ends here (no further turn)


class RewardCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: str
    workload: str
    scorer: str
    output_token_ids: list[list[int]]  # per turn
    metadata: Metadata = Field(default_factory=dict)
    time_scale: float = Field(default=1.0, gt=0)


# -- the built-in tool and scorer -----------------------------------------------------------

def _seed(session_id: str, metadata: Metadata) -> int:
    return int(metadata.get("sim_seed", zlib.crc32(session_id.encode())))


def per_turn_value(metadata: Metadata, key: str, turn: int) -> float | None:
    """Turn `turn`'s value of a comma-separated list in metadata (a simulated session's truth)."""
    raw = metadata.get(key)
    if not isinstance(raw, str) or not raw:
        return None
    parts = raw.split(",")
    return float(parts[turn]) if turn < len(parts) else None


def sim_tool(call: dict) -> dict:
    """The simulated tool: sleep its latency, return observation token ids; deterministic.

    With a simulated session's truth in metadata (`sim_seed`, `sim_turns`,
    `sim_tool_latency_s`, `sim_observation_tokens`: comma-separated, one per gap between turns)
    it replays it, observation ids as `SessionTruth.observation_token_ids`. Without it, draws
    from (seed, turn): latency LN(0.15 s, 1.0), observation LN(200, 1.0) capped at 2,048 tokens,
    and the episode runs to `max_turns`. Latencies are simulated seconds, divided by time_scale.
    """
    from sim.workloads.truth import token_ids

    c = ToolCall.model_validate(call)
    m = c.metadata
    seed = _seed(c.session_id, m)
    rng = np.random.default_rng([seed, 3, c.turn])
    latency = per_turn_value(m, "sim_tool_latency_s", c.turn)
    if latency is None:
        latency = 0.15 * math.exp(rng.standard_normal())
    n_obs = per_turn_value(m, "sim_observation_tokens", c.turn)
    if n_obs is None:
        n_obs = min(2048.0, 200 * math.exp(rng.standard_normal()))
    time.sleep(latency / c.time_scale)
    vocab = int(m.get("sim_vocab", DEFAULT_VOCAB))
    obs = token_ids((seed, 2, c.turn), max(1, round(n_obs)), vocab)
    turns = int(m.get("sim_turns", c.max_turns))
    return ToolOutcome(observation_token_ids=obs, done=c.turn + 1 >= turns).model_dump()


def parity_scorer(call: dict) -> float:
    """A deterministic stand-in reward: the share of even token ids in the final turn's output,
    after `sim_final_latency_s` (simulated seconds; the verifier's run time) has passed."""
    c = RewardCall.model_validate(call)
    wait = c.metadata.get("sim_final_latency_s", 0.0)
    if isinstance(wait, int | float) and wait > 0:
        time.sleep(float(wait) / c.time_scale)
    last = c.output_token_ids[-1] if c.output_token_ids else []
    return sum(1 for t in last if t % 2 == 0) / len(last) if last else 0.0


TOOLS: dict[str, Callable[[dict], dict]] = {"sim": sim_tool}
SCORERS: dict[str, Callable[[dict], float]] = {"parity": parity_scorer}


def resolve(name: str, registry: dict[str, Callable]) -> Callable:
    if name in registry:
        return registry[name]
    module, sep, attr = name.partition(":")
    if not sep:
        raise ToolError(f"tool: unknown name {name!r}; known: {', '.join(sorted(registry))} "
                        "or package.module:function")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ToolError(f"tool: cannot import {name!r}: {exc}") from None


def run_tool(call: dict) -> dict:
    """The RQ job (and the inline call): resolve the session's tool and run it."""
    return resolve(call["tool"], TOOLS)(call)


def run_reward(call: dict) -> float:
    return float(resolve(call["scorer"], SCORERS)(call))


# -- executors ------------------------------------------------------------------------------

class ToolExecutor(Protocol):
    async def call_tool(self, call: ToolCall) -> ToolOutcome: ...

    async def score(self, call: RewardCall) -> float: ...

    async def aclose(self) -> None: ...


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class InlineExecutor:
    """Each call on a daemon thread of its own: a tool that sleeps (the simulated one) costs no
    CPU, and a call abandoned on timeout or drain never holds up the worker's exit."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s

    async def _run(self, what: str, fn: Callable[[dict], Any], payload: dict) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not fut.done():
                fut.set_result(value) if ok else fut.set_exception(value)

        def target() -> None:
            try:
                value, ok = fn(payload), True
            except BaseException as exc:  # handed to the caller, who decides
                value, ok = exc, False
            try:
                loop.call_soon_threadsafe(settle, ok, value)
            except RuntimeError:  # the loop is gone: nobody waits for this call any more
                pass

        threading.Thread(target=target, name=f"tool-{payload.get('session_id')}",
                         daemon=True).start()
        try:
            return await asyncio.wait_for(fut, self.timeout_s)
        except TimeoutError:
            raise ToolError(f"{what}: timed out after {self.timeout_s:g}s") from None
        except ToolError:
            raise
        except Exception as exc:  # the tool's own failure becomes the session's reason
            raise ToolError(f"{what}: {describe_error(exc)}") from None

    async def call_tool(self, call: ToolCall) -> ToolOutcome:
        out = await self._run(f"tool {call.tool}", run_tool, call.model_dump())
        return ToolOutcome.model_validate(out)

    async def score(self, call: RewardCall) -> float:
        return float(await self._run(f"reward {call.scorer}", run_reward, call.model_dump()))

    async def aclose(self) -> None:
        """Nothing to release: abandoned calls end on their own daemon threads."""


class RqExecutor:
    """Tool and reward calls as RQ jobs; results collected by one poller task."""

    def __init__(self, redis_url: str, timeout_s: float = 60.0, retries: int = 1,
                 poll_s: float = 0.05, failure_ttl_s: int = 24 * 3600) -> None:
        import redis
        from rq import Queue
        from rq.serializers import JSONSerializer

        self.timeout_s = timeout_s
        self.retries = retries
        self.poll_s = poll_s
        self.failure_ttl_s = failure_ttl_s
        self._redis = redis.Redis.from_url(redis_url)
        self._serializer = JSONSerializer
        self._queues = {name: Queue(name, connection=self._redis, serializer=JSONSerializer)
                        for name in (TOOLS_QUEUE, REWARDS_QUEUE)}
        # job id -> (future, what, deadline): every job still in flight
        self._waiting: dict[str, tuple[asyncio.Future, str, float]] = {}
        self._poller: asyncio.Task | None = None

    def _enqueue(self, queue: str, fn: Callable, payload: dict) -> str:
        from rq import Retry

        job = self._queues[queue].enqueue_call(
            fn, args=(payload,), timeout=max(1, math.ceil(self.timeout_s)), result_ttl=300,
            failure_ttl=self.failure_ttl_s,
            retry=Retry(max=self.retries) if self.retries > 0 else None)
        return job.id

    async def _submit(self, queue: str, what: str, fn: Callable, payload: dict) -> Any:
        job_id = await asyncio.to_thread(self._enqueue, queue, fn, payload)
        fut = asyncio.get_running_loop().create_future()
        # Past every attempt's RQ timeout plus slack: no tool worker is taking the jobs.
        deadline = time.monotonic() + self.timeout_s * (self.retries + 1) + 30.0
        self._waiting[job_id] = (fut, what, deadline)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll(), name="rq-poller")
        return await fut

    def _statuses(self, ids: list[str]) -> dict[str, tuple[str, Any]]:
        from rq.job import Job, JobStatus

        out: dict[str, tuple[str, Any]] = {}
        for job_id, job in zip(ids, Job.fetch_many(ids, connection=self._redis,
                                                   serializer=self._serializer)):
            if job is None:
                out[job_id] = ("failed", "job vanished from Redis")
                continue
            status = job.get_status(refresh=False)
            if status == JobStatus.FINISHED:
                out[job_id] = ("ok", job.return_value())
            elif status in (JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED):
                result = job.latest_result()
                exc = (result.exc_string or "") if result is not None else ""
                last = exc.strip().splitlines()[-1] if exc.strip() else str(status)
                out[job_id] = ("failed", last)
        return out

    async def _poll(self) -> None:
        while self._waiting:
            await asyncio.sleep(self.poll_s)
            ids = list(self._waiting)
            try:
                done = await asyncio.to_thread(self._statuses, ids)
            except Exception as exc:  # Redis hiccup: try again next tick
                done = {}
                last_error = describe_error(exc)
            else:
                last_error = ""
            now = time.monotonic()
            for job_id in ids:
                fut, what, deadline = self._waiting[job_id]
                if fut.done():  # the session was cancelled meanwhile
                    del self._waiting[job_id]
                    continue
                if job_id in done:
                    kind, value = done.pop(job_id)
                    del self._waiting[job_id]
                    if kind == "ok":
                        fut.set_result(value)
                    else:
                        fut.set_exception(ToolError(f"{what}: {value} (rq job {job_id})"))
                elif now > deadline:
                    del self._waiting[job_id]
                    why = f"; {last_error}" if last_error else "; is a tool worker running?"
                    fut.set_exception(ToolError(f"{what}: no result from rq job {job_id}{why}"))

    async def call_tool(self, call: ToolCall) -> ToolOutcome:
        out = await self._submit(TOOLS_QUEUE, f"tool {call.tool}", run_tool, call.model_dump())
        return ToolOutcome.model_validate(out)

    async def score(self, call: RewardCall) -> float:
        return float(await self._submit(REWARDS_QUEUE, f"reward {call.scorer}", run_reward,
                                        call.model_dump()))

    async def aclose(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        self._redis.close()


def make_executor(kind: str, redis_url: str, timeout_s: float = 60.0, retries: int = 1
                  ) -> InlineExecutor | RqExecutor:
    if kind == "inline":
        return InlineExecutor(timeout_s)
    if kind == "rq":
        return RqExecutor(redis_url, timeout_s, retries)
    raise ValueError(f"tools: {kind!r} must be 'inline' or 'rq'")


def run_tool_worker(redis_url: str, queues: tuple[str, ...] = (TOOLS_QUEUE, REWARDS_QUEUE),
                    burst: bool = False, name: str | None = None) -> None:
    """`rollout-broker tools`: an RQ worker on the tool and reward queues (JSON serializer)."""
    import redis
    from rq import Queue, Worker
    from rq.serializers import JSONSerializer

    conn = redis.Redis.from_url(redis_url)
    worker = Worker([Queue(q, connection=conn, serializer=JSONSerializer) for q in queues],
                    connection=conn, serializer=JSONSerializer, name=name)
    worker.work(burst=burst, logging_level="WARNING")
