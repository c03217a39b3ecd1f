"""Redis work written once, run by a blocking client or by an asyncio one.

A *plan* is a generator that yields the Redis work it needs and receives the replies:

    def read_mixture(keys):
        fields = yield cmd("hgetall", keys.mixture)
        return {as_text(k): float(v) for k, v in fields.items()}

It does no I/O itself, so the same plan serves `RolloutClient` (through `Runner`, on a
`redis.Redis`) and `AsyncRolloutClient` (through `AsyncRunner`, on a `redis.asyncio.Redis`)
and every rule it holds (validation, delivery buffer, acknowledgements) exists once. Steps:

- `Batch`: commands and Lua scripts sent in one round trip (a pipeline; `transaction=True`
  makes it MULTI/EXEC); the plan receives the list of replies. `cmd(...)` and
  `script(...)` are one-step batches whose reply is the command's own.
- `Sleep`: wait without holding the connection.
- `Guard`: run another plan, waiting out a Redis outage (broker/redis_conn.py) until a
  deadline; after it, either raise the last error (`quiet=False`) or hand back None.
- `durable(calls, durability)`: writes that must survive a failover; they count as done only
  once enough replicas hold them (WAIT, in the same round trip).

An error a step raises is thrown into the plan at its `yield`, so a plan can catch it (e.g.
BUSYGROUP when a consumer group already exists).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis

from broker.redis_conn import Durability, NotReplicatedError, Outage, is_outage, single_attempt
from broker.scripts import SCRIPT_NAMES, Scripts, script_source

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Cmd:
    """One Redis command: the redis-py method `name` called with `args` and `kwargs`. `once`:
    not sent again after a lost reply (a read that delivers: broker.redis_conn.single_attempt);
    its round trip raises instead."""

    name: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    once: bool = False


@dataclass(frozen=True, slots=True)
class ScriptCall:
    """One of broker/lua/'s scripts (EVALSHA, loading it on NOSCRIPT)."""

    name: str
    keys: list
    args: list


@dataclass(frozen=True, slots=True)
class Batch:
    calls: tuple[Cmd | ScriptCall, ...]
    transaction: bool = False
    single: bool = False  # the plan wants the one call's reply, not a list


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


@dataclass(frozen=True, slots=True)
class Guard:
    """`plan(*args)`, tried again after each outage error until the monotonic `deadline`."""

    plan: Callable[..., Generator]
    args: tuple
    deadline: float
    quiet: bool = False  # past the deadline: None instead of the error


Step = Batch | Sleep | Guard
Plan = Generator[Step, Any, T]


def cmd(name: str, *args: Any, **kwargs: Any) -> Batch:
    return Batch((Cmd(name, args, kwargs),), single=True)


def script(name: str, keys: list, args: list) -> Batch:
    return Batch((ScriptCall(name, keys, args),), single=True)


def batch(calls: list[Cmd | ScriptCall], transaction: bool = False) -> Batch:
    return Batch(tuple(calls), transaction=transaction)


def durable(calls: list[Cmd | ScriptCall], durability: Durability) -> Plan[list]:
    """`calls` in one round trip, then, when `durability` asks for replicas, WAIT on the same
    connection (WAIT counts the replicas holding everything this connection wrote, so it must
    not go out on another one from the pool). Returns the calls' replies; raises
    NotReplicatedError (an outage: the caller retries the idempotent writes) when fewer
    replicas confirmed them in time; the runner then drops its idle connections, so the retry
    asks the sentinels where the primary is (one without replicas may just have been
    replaced: after a SENTINEL FAILOVER the old primary takes writes for seconds). Every write
    the system must not lose in a failover goes through here: enqueue, admission, finish,
    hand-back, results delivery and acknowledgement.

    A PING goes between the calls and the WAIT. WAIT counts from the connection's write
    offset, which Redis 6.2 and 7.0 set after each command the connection runs, not when a
    blocked command is served later: an XREADGROUP BLOCK that another client's XADD serves
    propagates its delivery after that offset, so a bare WAIT behind it returns at once, before
    any replica has the delivery (a failover then delivers the entry again: one CI run handed
    a result twice). The PING runs after the read is served and moves the offset past it.
    (Redis 7.2 runs a served blocked command again, which sets the offset itself.)"""
    if not calls:
        return []
    if not durability.replicas:
        if len(calls) == 1:  # one call goes out alone, as `cmd` and `script` send it
            return [(yield Batch(tuple(calls), single=True))]
        return (yield batch(calls))
    replies = yield batch([*calls, Cmd("ping", ()),
                           Cmd("wait", (durability.replicas, durability.timeout_ms))])
    durability.confirm(replies[-1])
    return replies[:-2]


def ensure_group(stream: str, group: str, start_id: str = "0") -> Plan[None]:
    """Create consumer group `group` on `stream` (and the stream); one that exists is kept."""
    try:
        yield cmd("xgroup_create", stream, group, id=start_id, mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def _attempts(step: Batch) -> AbstractContextManager:
    """A batch holding a `once` command is sent once."""
    if any(isinstance(c, Cmd) and c.once for c in step.calls):
        return single_attempt()
    return nullcontext()


class Runner:
    """Runs plans on a blocking client; `outage` paces the waits of `Guard` steps."""

    def __init__(self, client: redis.Redis, outage: Outage | None = None,
                 scripts: Scripts | None = None) -> None:
        self.client = client
        self.outage = outage  # needed by plans with `Guard` steps
        self._scripts = scripts

    @property
    def scripts(self) -> Scripts:
        if self._scripts is None:
            self._scripts = Scripts(self.client)
        return self._scripts

    def run(self, plan: Plan[T]) -> T:
        reply: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = plan.throw(error) if error is not None else plan.send(reply)
            except StopIteration as done:
                return done.value
            except NotReplicatedError:
                self.client.connection_pool.disconnect(inuse_connections=False)
                raise
            reply, error = None, None
            try:
                reply = self._step(step)
            except Exception as exc:  # handed to the plan, which may catch it
                error = exc

    def _step(self, step: Step) -> Any:
        if isinstance(step, Batch):
            with _attempts(step):
                if step.single and not step.transaction:
                    return self._call(self.client, step.calls[0])
                pipe = self.client.pipeline(transaction=step.transaction)
                for c in step.calls:
                    self._call(pipe, c)
                replies = pipe.execute()
            return replies[0] if step.single else replies
        if isinstance(step, Sleep):
            time.sleep(step.seconds)
            return None
        if isinstance(step, Guard):
            if self.outage is None:
                raise TypeError("plan step: a Guard needs a Runner made with an Outage")
            try:
                return self.outage.call(lambda: self.run(step.plan(*step.args)),
                                        deadline=step.deadline)
            except Exception as exc:
                if step.quiet and is_outage(exc):
                    return None
                raise
        raise TypeError(f"plan step: {step!r} is not a Batch, Sleep or Guard")

    def _call(self, target: Any, c: Cmd | ScriptCall) -> Any:
        if isinstance(c, ScriptCall):
            return getattr(self.scripts, c.name)(keys=c.keys, args=c.args, client=target)
        return getattr(target, c.name)(*c.args, **c.kwargs)


class AsyncScripts:
    """broker/lua/'s scripts registered on an asyncio client (as `Scripts` on a blocking one)."""

    def __init__(self, client: aioredis.Redis) -> None:
        for name in SCRIPT_NAMES:
            setattr(self, name, client.register_script(script_source(name)))


class AsyncRunner:
    """Runs plans on a `redis.asyncio` client: a plan waiting on Redis (a blocking read, a
    backoff) holds no thread and no lock, so other calls run meanwhile."""

    def __init__(self, client: aioredis.Redis, outage: Outage) -> None:
        self.client = client
        self.outage = outage
        self.scripts = AsyncScripts(client)

    async def run(self, plan: Plan[T]) -> T:
        reply: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = plan.throw(error) if error is not None else plan.send(reply)
            except StopIteration as done:
                return done.value
            except NotReplicatedError:
                await self.client.connection_pool.disconnect(inuse_connections=False)
                raise
            reply, error = None, None
            try:
                reply = await self._step(step)
            except Exception as exc:
                error = exc

    async def _step(self, step: Step) -> Any:
        if isinstance(step, Batch):
            with _attempts(step):
                if step.single and not step.transaction:
                    return await self._call(self.client, step.calls[0])
                pipe = self.client.pipeline(transaction=step.transaction)
                for c in step.calls:
                    await self._queue(pipe, c)
                replies = await pipe.execute()
            return replies[0] if step.single else replies
        if isinstance(step, Sleep):
            await asyncio.sleep(step.seconds)
            return None
        if isinstance(step, Guard):
            try:
                return await self._guarded(step)
            except Exception as exc:
                if step.quiet and is_outage(exc):
                    return None
                raise
        raise TypeError(f"plan step: {step!r} is not a Batch, Sleep or Guard")

    async def _guarded(self, step: Guard) -> Any:
        """`Outage.call`'s loop, waiting with asyncio."""
        while True:
            try:
                out = await self.run(step.plan(*step.args))
            except Exception as exc:
                if not is_outage(exc):
                    raise
                wait = self.outage.failed(exc)
                if time.monotonic() + wait > step.deadline:
                    raise
                await asyncio.sleep(wait)
                continue
            self.outage.ok()
            return out

    async def _call(self, target: aioredis.Redis, c: Cmd | ScriptCall) -> Any:
        if isinstance(c, ScriptCall):
            return await getattr(self.scripts, c.name)(keys=c.keys, args=c.args, client=target)
        return await getattr(target, c.name)(*c.args, **c.kwargs)

    async def _queue(self, pipe: Any, c: Cmd | ScriptCall) -> None:
        """Add a call to an asyncio pipeline (queuing returns the pipeline; scripts queue
        through a coroutine that loads them first)."""
        if isinstance(c, ScriptCall):
            await getattr(self.scripts, c.name)(keys=c.keys, args=c.args, client=pipe)
        else:
            getattr(pipe, c.name)(*c.args, **c.kwargs)
