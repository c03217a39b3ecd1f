"""Tool calls and reward scoring for the worker, run inline or as RQ jobs on CPU tool workers.

A tool is a plain function `fn(call: dict) -> dict` taking a `ToolCall` as JSON (the
conversation so far as token ids and text) and returning a `ToolOutcome` as JSON (observation
token ids or text, or `done`); a reward scorer is `fn(call: dict) -> float` taking a
`RewardCall` (the trajectory, each turn's output as ids and text). JSON both ways, so RQ stores
them with its JSONSerializer (never pickle). `examples/arith_env.py` is a real environment: a
calculator tool and an arithmetic-answer reward.

Which functions may run is the operator's choice, never the session's: a session names a key
(`metadata.tool`, `metadata.reward`) of the `ToolRegistry` the worker (or the RQ tool worker)
loaded at start, from
- the built-ins: tool `sim` (the simulated tool) and reward `parity` (a stand-in score);
- Python entry points of installed packages, groups `rollout_broker.tools` and
  `rollout_broker.rewards` (`name = "package.module:function"`);
- a TOML file given with `--tool-config` or `RB_TOOL_CONFIG`:

      [tools]
      search = "my_env.tools:search"
      [rewards]
      math = "my_env.rewards:math_verify"

  (later sources replace earlier keys). Every entry is imported at start, so a typo stops the
  process with one line naming it. A key that is not registered fails only the session naming
  it (`ToolError`); a session that names no reward gets `reward: null`.

Executors:
- `InlineExecutor` runs the function on a thread of the worker (tests, the demo). A timeout
  abandons the call (a Python thread cannot be killed), so the session fails on time.
- `RqExecutor` enqueues on the namespace's RQ queues (`tool_queues`: `rb:{<ns>}:tools`,
  `rb:{<ns>}:rewards`; token ids packed, `pack_token_fields`) with RQ's job timeout (the work horse
  is killed), `Retry(max=retries)`, and its failed-job registry keeping what failed for
  `failure_ttl`. CPU tool workers: `rollout-broker tools --redis-url URL`; the registry that
  counts is theirs. A job's success callback pushes its result onto the executor's reply list
  (`reply_to_caller`), read by one listener task as it arrives; one poller task fetches the
  status of every job still waiting in one round trip per `poll_s` (failures, and results whose
  push was lost), and rides out a Redis outage until the call's deadline. The queues
  may live on a Redis of their own (`--tools-redis-url`, RB_TOOLS_REDIS_URL), and must when the
  main one is a Redis Cluster: RQ's keys span hash slots (`tools_redis_url`).
Both raise `ToolError` with the reason when the call fails or times out (the session's fault),
`ToolUnavailable` when the tool service itself could not be used (the worker hands the session
back); nothing a tool raises (`SystemExit` included) escapes the session's task.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import math
import os
import signal
import threading
import time
import tomllib
import uuid
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import redis
from pydantic import BaseModel, ConfigDict, Field
from rq import SimpleWorker

try:
    from rq.exceptions import StopRequested
except ImportError:  # rq before 2.0
    from rq.worker import StopRequested

from broker.body import pack_ids, unpack_ids
from broker.keys import Keys
from broker.redis_cluster import is_cluster_url
from broker.redis_conn import BACKOFF_CAP_S, Outage, check_redis_url, connect, is_outage
from broker.session import REGISTRY_KEY_RE

log = logging.getLogger("rollout_broker.tools")

def tool_queues(namespace: str) -> tuple[str, str]:
    """The RQ queues of one namespace (RL job): tool calls, then reward scoring. Per namespace,
    so that two jobs on one Redis never run each other's tools or leave jobs in each other's
    way."""
    keys = Keys(namespace)
    return keys.tool_queue, keys.reward_queue


def purge_tool_queues(r: redis.Redis, namespace: str, batch: int = 500) -> int:
    """Delete everything of the namespace's tool queues in Redis: its jobs (queued, and those
    in each registry: started, finished, failed, deferred, scheduled, canceled) with their
    results, the queues and registries, and the executors' reply lists. For a run that owns
    the namespace and ends (the demo), once its tool workers and executors have stopped; RQ
    keeps queued jobs forever, so without it every run left its unfinished calls behind.
    Returns how many jobs were deleted."""
    from rq import Queue
    from rq.job import Job
    from rq.serializers import JSONSerializer

    queues = tool_queues(namespace)
    deleted = 0
    for name in queues:
        q = Queue(name, connection=r, serializer=JSONSerializer)
        registries = [q.started_job_registry, q.finished_job_registry, q.failed_job_registry,
                      q.deferred_job_registry, q.scheduled_job_registry,
                      q.canceled_job_registry]
        ids = set(q.get_job_ids())
        for registry in registries:
            ids.update(registry.get_job_ids())
        ordered = sorted(ids)
        for i in range(0, len(ordered), batch):
            jobs = [j for j in Job.fetch_many(ordered[i:i + batch], connection=r,
                                              serializer=JSONSerializer) if j is not None]
            with r.pipeline(transaction=False) as pipe:
                for job in jobs:  # the queue goes whole below: no LREM per queued job
                    job.delete(pipeline=pipe, remove_from_queue=False)
                pipe.execute()
            deleted += len(jobs)
        q.delete(delete_jobs=False)
        r.delete(*(registry.key for registry in registries))
    replies = list(r.scan_iter(match=Keys(namespace).tool_replies("*"), count=1000))
    if replies:
        r.delete(*replies)
    return deleted


TOOLS_REDIS_ENV = "RB_TOOLS_REDIS_URL"


def _refuse_cluster(url: str, field: str) -> None:
    if is_cluster_url(url):
        raise ValueError(
            f"{field}: rq cannot run on a Redis Cluster (its keys span hash slots and it WATCHes "
            "and MULTIs across them); give the tool queues a plain or Sentinel Redis with "
            f"--tools-redis-url (or ${TOOLS_REDIS_ENV})")


def tools_redis_url(redis_url: str, tools_redis_url: str | None = None) -> str:
    """The Redis RQ's tool and reward queues live on: `tools_redis_url` when given, else the
    main `redis_url`. Raises ValueError naming the setting when it is unusable, or a Redis
    Cluster (which RQ cannot use)."""
    field = "tools_redis_url" if tools_redis_url else "redis_url"
    url = tools_redis_url or redis_url
    check_redis_url(url, field)
    _refuse_cluster(url, field)
    return url
TOOL_ENTRY_POINTS = "rollout_broker.tools"
REWARD_ENTRY_POINTS = "rollout_broker.rewards"
TOOL_CONFIG_ENV = "RB_TOOL_CONFIG"
DEFAULT_VOCAB = 32_000  # below every profile's vocabulary, so simulated ids are valid anywhere

Metadata = dict[str, str | int | float | bool]


class ToolError(RuntimeError):
    """A tool or scorer call that failed or timed out; the message is the session's error."""


class ToolUnavailable(RuntimeError):
    """The tool service could not be used (Redis down past the call's deadline, no tool worker
    taking jobs): not the session's fault, so the worker hands the session back."""


class ToolCall(BaseModel):
    """What a tool receives: the conversation so far, as token ids and as text (the engine's
    own detokenization), and the turn it acts on."""

    model_config = ConfigDict(extra="forbid")

    session_id: str
    workload: str
    tool: str
    turn: int = Field(ge=0)  # the turn whose output the tool acts on (0-based)
    max_turns: int = Field(ge=1)
    output_token_ids: list[int]  # that turn's output
    output_text: str = ""  # that turn's output as text
    history_token_ids: list[int] = Field(default_factory=list)  # prompt, outputs, observations
    history_text: str = ""  # the same as text
    context_tokens: int = Field(ge=0)  # history length so far
    metadata: Metadata = Field(default_factory=dict)
    time_scale: float = Field(default=1.0, gt=0)  # simulated seconds per wall second


class ToolOutcome(BaseModel):
    """What a tool returns: an observation for the next turn, as token ids or as text (the
    worker tokenizes it with the engine's tokenizer), or `done` to end the episode."""

    model_config = ConfigDict(extra="forbid")

    observation_token_ids: list[int] = Field(default_factory=list)
    observation_text: str | None = None  # appended after the ids, tokenized by the engine
    done: bool = False  # the episode ends here (no further turn)


class RewardCall(BaseModel):
    """What a reward scorer receives: the whole trajectory (`SessionResult.trajectory()`'s
    token ids and loss mask) and each turn's output as ids and as text."""

    model_config = ConfigDict(extra="forbid")

    session_id: str
    workload: str
    scorer: str
    output_token_ids: list[list[int]]  # per turn
    output_texts: list[str] = Field(default_factory=list)  # per turn
    token_ids: list[int] = Field(default_factory=list)  # the trajectory
    loss_mask: list[int] = Field(default_factory=list)  # 1 on model tokens
    metadata: Metadata = Field(default_factory=dict)
    time_scale: float = Field(default=1.0, gt=0)


# -- the built-in tool and scorer -----------------------------------------------------------

def _seed(session_id: str, metadata: Metadata) -> int:
    return int(metadata.get("sim_seed", zlib.crc32(session_id.encode())))


def per_turn_value(metadata: Metadata, key: str, turn: int) -> float | None:
    """Turn `turn`'s value of a simulated session's truth in metadata: a comma-separated list
    (one value per turn), or one number for every turn."""
    raw = metadata.get(key)
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        return float(raw)
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


class RegistryError(ValueError):
    """The operator's tool configuration is unusable; the message names the entry."""


@dataclass(frozen=True, slots=True)
class ToolRegistry:
    """The tools and reward scorers sessions may name, by key."""

    tools: Mapping[str, Callable[[dict], dict]]
    rewards: Mapping[str, Callable[[dict], float]]

    def tool(self, name: str) -> Callable[[dict], dict]:
        fn = self.tools.get(name)
        if fn is None:
            raise ToolError(f"tool: {name!r} is not registered on this worker; registered: "
                            f"{', '.join(sorted(self.tools)) or 'none'}")
        return fn

    def reward(self, name: str) -> Callable[[dict], float]:
        fn = self.rewards.get(name)
        if fn is None:
            raise ToolError(f"reward: {name!r} is not registered on this worker; registered: "
                            f"{', '.join(sorted(self.rewards)) or 'none'}")
        return fn


BUILTIN_TOOLS: dict[str, Callable[[dict], dict]] = {"sim": sim_tool}
BUILTIN_REWARDS: dict[str, Callable[[dict], float]] = {"parity": parity_scorer}


def import_callable(target: object, where: str) -> Callable:
    """The function `target` names as 'package.module:function'; RegistryError (a ValueError)
    naming `where` when it does not."""
    if not isinstance(target, str) or target.count(":") != 1:
        raise RegistryError(f"{where}: {target!r} must be 'package.module:function'")
    module, attr = target.split(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise RegistryError(f"{where}: cannot import {target!r}: {exc}") from None
    if not callable(fn):
        raise RegistryError(f"{where}: {target!r} is not callable")
    return fn


def _check_key(key: str, where: str) -> str:
    if not REGISTRY_KEY_RE.match(key):
        raise RegistryError(f"{where}: key {key!r} must be 1-64 letters, digits, '_', '.' or '-'")
    return key


def load_registry(config: str | Path | None = None) -> ToolRegistry:
    """Built-ins, then installed entry points, then the TOML file `config` (see the module)."""
    tools: dict[str, Callable] = dict(BUILTIN_TOOLS)
    rewards: dict[str, Callable] = dict(BUILTIN_REWARDS)
    for group, table in ((TOOL_ENTRY_POINTS, tools), (REWARD_ENTRY_POINTS, rewards)):
        for ep in entry_points(group=group):
            where = f"entry point {group}.{ep.name}"
            table[_check_key(ep.name, where)] = import_callable(ep.value, where)
    if config:  # None or "" (an unset environment variable): no file
        path = Path(config)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise RegistryError(f"tool-config: cannot read {str(path)!r}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise RegistryError(f"tool-config: {str(path)!r} is not valid TOML: {exc}") from None
        unknown = set(data) - {"tools", "rewards"}
        if unknown:
            raise RegistryError(f"tool-config: unknown table(s) {', '.join(sorted(unknown))} in "
                                f"{str(path)!r}; expected [tools] and [rewards]")
        for section, table in (("tools", tools), ("rewards", rewards)):
            entries = data.get(section, {})
            if not isinstance(entries, dict):
                raise RegistryError(f"tool-config: [{section}] must be a table of "
                                    "key = \"package.module:function\"")
            for key, target in entries.items():
                where = f"tool-config {section}.{key}"
                table[_check_key(key, where)] = import_callable(target, where)
    return ToolRegistry(tools=tools, rewards=rewards)


_active: ToolRegistry | None = None
_active_lock = threading.Lock()


def use_registry(registry: ToolRegistry) -> None:
    """Make `registry` the one RQ jobs in this process resolve names in."""
    global _active
    with _active_lock:
        _active = registry


def active_registry() -> ToolRegistry:
    """This process's registry: the one set by `use_registry`, else loaded once from
    $RB_TOOL_CONFIG (or the built-ins and entry points alone)."""
    global _active
    with _active_lock:
        if _active is None:
            _active = load_registry(os.environ.get(TOOL_CONFIG_ENV) or None)
        return _active


# The token-id fields of ToolCall, RewardCall and ToolOutcome. On RQ they travel packed
# (broker/body.py `pack_ids`: base64 of fixed-width ids, about 2.3 characters a token for a
# 128k vocabulary against 7 as JSON numbers), because RQ serializes, zlib-compresses and stores
# a job's arguments when it is enqueued and again when it finishes: a reward call carrying a
# 4,400-token trajectory cost 3.4 ms of the enqueuing worker's CPU and 5.8 ms of the tool
# worker's as plain lists, 1.0 and 3.3 ms packed. The functions see plain lists either way.
TOKEN_ID_FIELDS = ("output_token_ids", "history_token_ids", "token_ids", "loss_mask",
                   "observation_token_ids")


def pack_token_fields(d: dict) -> dict:
    """`d` with each token-id list (or list of lists) as a packed string; a list that cannot
    be packed (empty, or an id of 2^32 or more) stays a list."""
    out = dict(d)
    for key in TOKEN_ID_FIELDS:
        value = d.get(key)
        if not isinstance(value, list) or not value:
            continue
        if isinstance(value[0], list):
            out[key] = [pack_ids(ids) or ids for ids in value]
        else:
            out[key] = pack_ids(value) or value
    return out


def unpack_token_fields(d: dict) -> dict:
    """The inverse of `pack_token_fields`; plain lists pass through (a job enqueued by an
    earlier version). ValueError naming the field when a string is not a packed one."""
    out = dict(d)
    for key in TOKEN_ID_FIELDS:
        value = d.get(key)
        if isinstance(value, str):
            out[key] = unpack_ids(value, key)
        elif isinstance(value, list) and any(isinstance(ids, str) for ids in value):
            out[key] = [unpack_ids(ids, key) if isinstance(ids, str) else ids for ids in value]
    return out


def run_tool(call: dict) -> dict:
    """The RQ job: run the session's tool as this process's registry names it (token ids
    packed both ways, `pack_token_fields`)."""
    outcome = active_registry().tool(call["tool"])(unpack_token_fields(call))
    return pack_token_fields(outcome) if isinstance(outcome, dict) else outcome


def run_reward(call: dict) -> float:
    """The RQ job: score with the session's reward as this process's registry names it."""
    return float(active_registry().reward(call["scorer"])(unpack_token_fields(call)))


REPLY_TTL_S = 3600  # a reply list outlives its executor by this much at most


def reply_to_caller(job, connection, result, *args, **kwargs) -> None:
    """RQ's success callback of every tool and reward job: push the result onto the reply
    list of the executor that enqueued it (`job.meta["reply_to"]`), which waits on it, so the
    session goes on at once instead of at the executor's next poll. It never raises: RQ would
    count a failed callback as a failed job and run the tool again; the poll finds the
    result in RQ's own record instead."""
    key = job.meta.get("reply_to")
    if not key:
        return
    try:
        pipe = connection.pipeline(transaction=False)
        pipe.rpush(key, json.dumps({"id": job.id, "value": result}))
        pipe.expire(key, REPLY_TTL_S)
        pipe.execute()
    except Exception as exc:
        log.warning("rq job %s: could not push its result to %s (%s); the caller polls it",
                    job.id, key, type(exc).__name__)


# -- executors ------------------------------------------------------------------------------

class ToolExecutor(Protocol):
    async def call_tool(self, call: ToolCall) -> ToolOutcome: ...

    async def score(self, call: RewardCall) -> float: ...

    async def aclose(self) -> None: ...


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class InlineExecutor:
    """Each call on a daemon thread of its own: a tool that sleeps (the simulated one) costs no
    CPU, and a call abandoned on timeout or drain never holds up the worker's exit. Names are
    resolved in `registry` (default: `active_registry()`)."""

    def __init__(self, timeout_s: float = 60.0, registry: ToolRegistry | None = None) -> None:
        self.timeout_s = timeout_s
        self.registry = registry or active_registry()

    async def _run(self, what: str, fn: Callable[[dict], Any], payload: dict) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not fut.done():
                fut.set_result(value) if ok else fut.set_exception(value)

        def target() -> None:
            try:
                value, ok = fn(payload), True
            except Exception as exc:  # handed to the caller, who decides
                value, ok = exc, False
            except BaseException as exc:  # SystemExit, KeyboardInterrupt: the tool's, not ours
                value, ok = ToolError(f"{what}: raised {describe_error(exc)}"), False
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
        fn = self.registry.tool(call.tool)
        out = await self._run(f"tool {call.tool}", fn, call.model_dump())
        return ToolOutcome.model_validate(out)

    async def score(self, call: RewardCall) -> float:
        fn = self.registry.reward(call.scorer)
        return float(await self._run(f"reward {call.scorer}", fn, call.model_dump()))

    async def aclose(self) -> None:
        """Nothing to release: abandoned calls end on their own daemon threads."""


class RqExecutor:
    """Tool and reward calls as RQ jobs. A job's success callback (`reply_to_caller`) pushes
    its result onto this executor's reply list, which one listener task reads as it arrives;
    a poller task fetches the status of every job still waiting each `poll_s`: failures, and
    results whose push was lost."""

    def __init__(self, redis_url: str, namespace: str = "default", timeout_s: float = 60.0,
                 retries: int = 1, poll_s: float = 0.25, failure_ttl_s: int = 24 * 3600) -> None:
        from rq import Queue
        from rq.serializers import JSONSerializer

        self.timeout_s = timeout_s
        self.retries = retries
        self.poll_s = poll_s
        self.failure_ttl_s = failure_ttl_s
        _refuse_cluster(redis_url, "tools_redis_url")
        self._redis = connect(redis_url)
        self._listen_redis = connect(redis_url)  # its own connections: it blocks on BLPOP
        self._outage = Outage("rq tool calls", log)
        self._serializer = JSONSerializer
        self._tools_queue, self._rewards_queue = tool_queues(namespace)
        self._queues = {name: Queue(name, connection=self._redis, serializer=JSONSerializer)
                        for name in (self._tools_queue, self._rewards_queue)}
        self._replies = Keys(namespace).tool_replies(uuid.uuid4().hex[:12])
        # job id -> (future, what, deadline): every job still in flight
        self._waiting: dict[str, tuple[asyncio.Future, str, float]] = {}
        self._poller: asyncio.Task | None = None
        self._listener: asyncio.Task | None = None

    def _enqueue(self, queue: str, what: str, fn: Callable, payload: dict) -> str:
        from rq import Callback, Retry

        # A description of our own: RQ's default is the call's repr, the whole payload (the
        # conversation so far) a second time, built here, stored and sent back and forth with
        # the job (`rq info` shows it).
        job = self._queues[queue].enqueue_call(
            fn, args=(pack_token_fields(payload),), timeout=max(1, math.ceil(self.timeout_s)),
            result_ttl=300, failure_ttl=self.failure_ttl_s, meta={"reply_to": self._replies},
            description=f"{what}, session {payload.get('session_id')}"
                        + (f", turn {payload['turn']}" if "turn" in payload else ""),
            on_success=Callback(reply_to_caller),
            retry=Retry(max=self.retries) if self.retries > 0 else None)
        return job.id

    async def _submit(self, queue: str, what: str, fn: Callable, payload: dict) -> Any:
        # Past every attempt's RQ timeout plus slack: no tool worker is taking the jobs.
        deadline = time.monotonic() + self.timeout_s * (self.retries + 1) + 30.0
        try:  # a Redis outage is waited out, up to the call's own deadline
            job_id = await asyncio.to_thread(self._outage.call, self._enqueue, queue, what, fn,
                                             payload, deadline=deadline)
        except Exception as exc:
            if not is_outage(exc):
                raise
            raise ToolUnavailable(f"{what}: could not enqueue the rq job: redis unavailable "
                                  f"({type(exc).__name__})") from None
        fut = asyncio.get_running_loop().create_future()
        self._waiting[job_id] = (fut, what, deadline)
        loop = asyncio.get_running_loop()
        if self._poller is None or self._poller.done():
            self._poller = loop.create_task(self._poll(), name="rq-poller")
        if self._listener is None or self._listener.done():
            self._listener = loop.create_task(self._listen(), name="rq-replies")
        return await fut

    def _read_replies(self, block_s: int = 1) -> list[bytes]:
        first = self._listen_redis.blpop([self._replies], timeout=block_s)
        if first is None:
            return []
        return [first[1], *(self._listen_redis.lpop(self._replies, 255) or [])]

    async def _listen(self) -> None:
        """Hand each pushed result to its call (`reply_to_caller`), until nothing waits."""
        while self._waiting:
            try:
                replies = await asyncio.to_thread(self._read_replies)
            except Exception as exc:  # an outage: the poller rides it out; listen again later
                if not is_outage(exc):
                    raise
                await asyncio.sleep(self._outage.failed(exc))
                continue
            for raw in replies:
                reply = json.loads(raw)
                entry = self._waiting.pop(reply["id"], None)
                if entry is not None and not entry[0].done():
                    entry[0].set_result(reply["value"])

    def _statuses(self, ids: list[str]) -> dict[str, tuple[str, Any]]:
        from rq.job import Job, JobStatus

        # Each job's status alone first: loading a whole job brings its payload (an agentic
        # call carries the conversation so far), and most jobs polled are still running.
        pipe = self._redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(Job.key_for(job_id), "status")
        ended = {JobStatus.FINISHED, JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED}
        ready = [job_id for job_id, st in zip(ids, pipe.execute())
                 if st is None or st.decode() in ended]
        out: dict[str, tuple[str, Any]] = {}
        if not ready:
            return out
        ids = ready
        for job_id, job in zip(ids, Job.fetch_many(ids, connection=self._redis,
                                                   serializer=self._serializer)):
            if job is None:
                out[job_id] = ("gone", "job vanished from Redis")
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
            except Exception as exc:  # an outage: try again next tick, until each deadline
                if not is_outage(exc):
                    raise
                self._outage.failed(exc)
                done = {}
                last_error = describe_error(exc)
            else:
                self._outage.ok()
                last_error = ""
            now = time.monotonic()
            for job_id in ids:
                entry = self._waiting.get(job_id)
                if entry is None:  # its pushed result reached it while we asked (`_listen`)
                    continue
                fut, what, deadline = entry
                if fut.done():  # the session was cancelled meanwhile
                    del self._waiting[job_id]
                    continue
                if job_id in done:
                    kind, value = done.pop(job_id)
                    del self._waiting[job_id]
                    if kind == "ok":
                        fut.set_result(value)
                    elif kind == "gone":
                        fut.set_exception(ToolUnavailable(f"{what}: {value} (rq job {job_id})"))
                    else:
                        fut.set_exception(ToolError(f"{what}: {value} (rq job {job_id})"))
                elif now > deadline:
                    del self._waiting[job_id]
                    why = f"; {last_error}" if last_error else "; is a tool worker running?"
                    fut.set_exception(ToolUnavailable(
                        f"{what}: no result from rq job {job_id}{why}"))

    async def call_tool(self, call: ToolCall) -> ToolOutcome:
        out = await self._submit(self._tools_queue, f"tool {call.tool}", run_tool,
                                 call.model_dump())
        return ToolOutcome.model_validate(unpack_token_fields(out) if isinstance(out, dict)
                                          else out)

    async def score(self, call: RewardCall) -> float:
        return float(await self._submit(self._rewards_queue, f"reward {call.scorer}", run_reward,
                                        call.model_dump()))

    async def aclose(self) -> None:
        for task in (self._poller, self._listener):  # (the reply list expires on its own)
            if task is not None:
                task.cancel()
        self._redis.close()
        self._listen_redis.close()


def make_executor(kind: str, redis_url: str, namespace: str, timeout_s: float = 60.0,
                  retries: int = 1, registry: ToolRegistry | None = None
                  ) -> InlineExecutor | RqExecutor:
    if kind == "inline":
        return InlineExecutor(timeout_s, registry)
    if kind == "rq":
        return RqExecutor(redis_url, namespace, timeout_s, retries)
    raise ValueError(f"tools: {kind!r} must be 'inline' or 'rq'")


STOP_CHECK_S = 1  # an idle tool worker looks for a stop this often (whole seconds: RQ's BLPOP)
# A tool worker's heartbeat or suspension look-up this soon after the last one is skipped: the
# idle loop beats again within STOP_CHECK_S, long before any expiry a beat set runs out.
REPEAT_S = 1.0


class ToolWorker(SimpleWorker):
    """RQ's in-process worker with fewer round trips and a stop it always sees
    (`run_tool_worker` sets `stop_event`: a SIGTERM/SIGINT, or its caller's stop)."""

    stop_event: threading.Event
    # Round trips: RQ sends a heartbeat outside a pipeline as three commands, one round
    # trip each, three times a job, writes the worker's state twice a job when once would
    # do, and asks Redis whether workers are suspended before every job; 21 round trips a
    # job in all. Here a beat is one pipeline, and is skipped within REPEAT_S of the last
    # one, in RQ's transaction or not; an unchanged state is not rewritten; suspension
    # (`rq suspend`) is looked up at most once in REPEAT_S: 10.
    _last_beat_at: float | None = None  # monotonic time of the last heartbeat sent
    _state_written: str | None = None  # the state last written outside a pipeline
    _suspension_checked_at: float | None = None

    def heartbeat(self, timeout=None, pipeline=None):
        t = time.monotonic()
        if pipeline is not None:  # part of RQ's transaction, which RQ sends at once
            self._last_beat_at = t
            return super().heartbeat(timeout, pipeline)
        if self._last_beat_at is not None and t - self._last_beat_at < REPEAT_S:
            return None
        try:
            with self.connection.pipeline(transaction=False) as pipe:
                super().heartbeat(timeout, pipe)
                pipe.execute()
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            # RQ's listening loop retries a lost connection forever, beating first each time;
            # a stop asked meanwhile ends it here (nothing can be popped while Redis is down).
            if self.stop_event.is_set():
                raise StopRequested() from None
            raise
        self._last_beat_at = t
        return None

    def set_state(self, state, pipeline=None):
        if pipeline is None and state == self._state_written:
            self._state = state
            return
        super().set_state(state, pipeline)
        self._state_written = state if pipeline is None else None

    def check_for_suspension(self, burst):
        t = time.monotonic()
        checked = self._suspension_checked_at
        if checked is not None and t - checked < REPEAT_S:
            return None
        self._suspension_checked_at = t
        return super().check_for_suspension(burst)

    def request_stop(self, signum, frame):  # RQ's handler of SIGTERM/SIGINT
        # An idle RQ worker raises StopRequested from the handler, that is from inside its
        # BLPOP or just after it: a job popped then is in no queue and no registry, lost
        # (its caller waits out its deadline). So the stop is only recorded here, and the
        # listening below ends at the next slice; a popped job runs first.
        self.stop_event.set()
        try:
            super().request_stop(signum, frame)
        except StopRequested:
            self._stop_requested = True

    def dequeue_job_and_maintain_ttl(self, timeout, max_idle_time=None):
        if timeout is None:  # burst: one non-blocking look
            return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
        # In slices, to see a stop. A stop that came before RQ installed its signal handlers
        # (RQ registers the worker first) ends the loop here too, in RQ's clean stop, which
        # deregisters the worker.
        while not (self._stop_requested or self.stop_event.is_set()):
            found = super().dequeue_job_and_maintain_ttl(STOP_CHECK_S, STOP_CHECK_S)
            if found is not None:
                return found
        return None

    def subscribe(self):
        # RQ's own listens for its commands (`rq` shutdown, stop-job) on a thread that
        # waits up to 60 s for a message, and redis-py 8.2's PubSubWorkerThread.stop()
        # waits for that thread: when the thread had read the unsubscribe of RQ's teardown
        # before stop() asked it to end, it waited out those 60 s before the worker could
        # exit (5 of 25 stops under load). This one waits at most STOP_CHECK_S.
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(
            sleep_time=STOP_CHECK_S, daemon=True,
            exception_handler=getattr(self, "_pubsub_exception_handler", None))


def run_tool_worker(redis_url: str, registry: ToolRegistry, namespace: str = "default",
                    burst: bool = False, name: str | None = None,
                    stop: threading.Event | None = None) -> None:
    """`rollout-broker tools`: an RQ worker on the namespace's tool and reward queues (JSON
    serializer), running the functions of `registry`. It runs the jobs in its own process
    (RQ's `SimpleWorker`), one after another: forking a work horse per job, RQ's default,
    costs more than most tool calls (a demo with it finished 4 sessions in 20 s where inline
    tools finished ~600). So a tool must not crash the interpreter; scale out with more tool
    workers.

    RQ waits out a lost connection while it listens, but quits its loop on one in the middle of
    a job; this loop then waits for Redis and starts RQ's loop again, so a Redis restart never
    ends the process. SIGTERM/SIGINT stop it (RQ's warm shutdown: a job it has taken from the
    queue runs first), as does setting `stop`; an idle worker stops within STOP_CHECK_S."""
    from rq import Queue
    from rq.serializers import JSONSerializer

    stop = stop or threading.Event()
    queues = tool_queues(namespace)
    _refuse_cluster(redis_url, "tools_redis_url")

    use_registry(registry)
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):  # until RQ installs its own
            signal.signal(signum, lambda *_: stop.set())
    outage = Outage("tool worker", log)
    conn = connect(redis_url)
    while not stop.is_set():
        try:
            # (RQ names its connection in Redis as it makes the worker: Redis must answer)
            worker = ToolWorker([Queue(q, connection=conn, serializer=JSONSerializer)
                                 for q in queues],
                                connection=conn, serializer=JSONSerializer, name=name)
            worker.stop_event = stop
            worker.max_connection_wait_time = BACKOFF_CAP_S  # RQ's own wait, capped like ours
            worker.work(burst=burst, logging_level="WARNING")
        except Exception as exc:  # an outage as RQ makes, registers or tears down the worker
            if not is_outage(exc):
                raise
            outage.failed(exc)
        if burst or stop.is_set():
            return
        # RQ left its loop without being asked to: wait for Redis, then start it again.
        try:
            outage.call(conn.ping, stop=stop)
        except Exception as exc:
            if not is_outage(exc):
                raise
            return  # stopped while Redis was down
