"""Redis clients that ride out an outage: a restart, a kill -9, a failover, an out-of-memory spell.

Two layers, both redis-py's own machinery plus one small tracker:
- `connect(url)`: every client of the project is made here, with redis-py's `Retry` and
  `ExponentialWithJitterBackoff` (capped at 0.5 s) on connection errors and timeouts, so a blip
  of a few hundred milliseconds is invisible; a longer outage raises one of `OUTAGE_ERRORS`
  after about a second.
- `Outage`: what a long-running loop (broker, worker, client call, tool worker) does with
  those errors: log once when the outage starts and once when Redis answers again, and wait
  between tries with the same capped backoff. A cap of 0.5 s means each process is back within
  about half a second of Redis answering.

Every script and write the loops repeat is idempotent (scripts check state before they change
it; see broker/lua/), so a command that ran but whose reply was lost may run again safely. One
command is not: a consumer-group read of new entries (XREADGROUP '>') delivers them, so sent
again after its reply was lost it returns the next ones, and those it delivered wait unseen in
the reader's pending list. Such reads run in `single_attempt()`: the error reaches the reader,
who reads its pending list again (`broker.streams.BacklogCursor`; the broker its queues').

Redis Sentinel: a URL `redis+sentinel://[[user]:password@]host1:26379,host2:26379/<service>[/<db>]`
gives a client of `Sentinel(...).master_for(service)`, which asks the sentinels where the primary
is on every new connection, so after a failover each process finds the new primary by itself
(the outage loops retry meanwhile). Writes that must survive a failover wait for replicas
(`Durability`, `broker.plans.durable`): 1 by default with Sentinel, 0 with a plain URL.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel
from redis.connection import URL_QUERY_ARGUMENT_PARSERS, parse_url
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.exceptions import (
    BusyLoadingError,
    MasterDownError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    TryAgainError,
)
from redis.asyncio.retry import Retry as AsyncRetry
from redis.retry import Retry

from broker.redis_cluster import (ClusterTarget, address_list, cluster_client, cluster_client_async,
                                  is_cluster_url, parse_cluster_url)

T = TypeVar("T")

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"  # every command's default (RB_REDIS_URL)
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 0.5
CONNECTION_RETRIES = 3
SOCKET_TIMEOUT_S = 15.0  # longer than any BLOCK we ask for; bounds a half-open connection
CONNECT_TIMEOUT_S = 2.0

SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_PORT = 26379
MIN_REPLICAS_ENV = "RB_REDIS_MIN_REPLICAS"
WAIT_TIMEOUT_MS = 1000  # a durable write waits this long for its replicas, then it is retried
# Query parameters that are ours, not redis-py's (taken out of a plain URL before redis-py
# reads it): how many replicas a durable write waits for, and for how long.
DURABILITY_PARAMS = ("min_replicas", "wait_timeout_ms")

# Errors that mean "Redis is not serving right now", not "this command is wrong":
# unreachable or timed out; loading its data after a restart (BusyLoadingError, a
# ConnectionError); out of memory (writes refused until memory is freed); a replica or a
# primary that lost its replicas during a failover; a script cache emptied by a restart.
# During a Sentinel failover: no primary known yet (MasterNotFoundError, a ConnectionError),
# the old primary turned replica (ReadOnlyError, which the Sentinel client turns into a
# ConnectionError), a durable write its replicas did not confirm (NotReplicatedError).
OUTAGE_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError, redis.TimeoutError, OutOfMemoryError, ReadOnlyError,
    MasterDownError, TryAgainError, NoScriptError,
)
# Replies (plain script or command errors) that mean the same: a write refused for memory
# inside a script; too few replicas for `min-replicas-to-write`; a write inside a script
# refused by a replica; a blocked read cut off because its primary became a replica; a
# durable write's WAIT reaching a primary demoted to a replica after the writes before it.
WAIT_ON_REPLICA = "WAIT cannot be used with replica instances"
OUTAGE_REPLIES = ("OOM command not allowed", "NOREPLICAS", "READONLY", "UNBLOCKED",
                  WAIT_ON_REPLICA)


class NotReplicatedError(redis.ConnectionError):
    """A durable write was not confirmed by enough replicas in time (WAIT): not done yet.
    Every such write is idempotent, so it is retried like any other outage."""


@dataclass(frozen=True, slots=True)
class Durability:
    """How many replicas must hold a write before it counts as done, and how long to wait."""

    replicas: int = 0
    timeout_ms: int = WAIT_TIMEOUT_MS

    def confirm(self, acked: int) -> None:
        """Raise NotReplicatedError unless WAIT's reply `acked` is enough."""
        if int(acked) < self.replicas:
            raise NotReplicatedError(f"write confirmed by {int(acked)} of {self.replicas} "
                                     f"replicas within {self.timeout_ms} ms")


NO_WAIT = Durability()  # a plain Redis: a write is done when the primary has it


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """A Redis URL read once: where to connect, with which options, how durable writes are."""

    url: str  # a plain URL without our own parameters; "" for Sentinel
    durability: Durability
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str = ""
    options: dict[str, Any] = field(default_factory=dict)  # Sentinel: the data nodes' options
    sentinel_options: dict[str, Any] = field(default_factory=dict)
    cluster: ClusterTarget | None = None  # a redis+cluster:// URL (broker/redis_cluster.py)

    @property
    def sentinel(self) -> bool:
        return bool(self.sentinels)


def _whole(name: str, raw: str, least: int) -> int:
    try:
        v = int(raw)
    except ValueError:
        v = least - 1
    if v < least:
        raise ValueError(f"{name}: {raw!r} must be a whole number ≥ {least}")
    return v


def _durability(params: dict[str, str], sentinel: bool) -> Durability:
    """The URL's `min_replicas`, else $RB_REDIS_MIN_REPLICAS, else 1 with Sentinel, 0 without."""
    raw = params.get("min_replicas")
    if raw is not None:
        replicas = _whole("min_replicas", raw, 0)
    elif os.environ.get(MIN_REPLICAS_ENV, "").strip():
        replicas = _whole(MIN_REPLICAS_ENV, os.environ[MIN_REPLICAS_ENV].strip(), 0)
    else:
        replicas = 1 if sentinel else 0
    timeout = params.get("wait_timeout_ms")
    return Durability(replicas, WAIT_TIMEOUT_MS if timeout is None
                      else _whole("wait_timeout_ms", timeout, 1))


def _sentinel_hosts(netloc: str) -> tuple[tuple[str, int], ...]:
    return address_list(netloc, SENTINEL_PORT, "sentinel address",
                        lambda host, raw: _whole(f"sentinel {host} port", raw, 1))


def _cluster_target(url: str) -> RedisTarget:
    """A `redis+cluster://` URL (broker/redis_cluster.py). Durable writes are not offered on a
    cluster: WAIT counts one connection's writes, and a cluster pipeline may send it on another."""
    cluster = parse_cluster_url(url, own_params=DURABILITY_PARAMS)
    durability = _durability(cluster.params, sentinel=False)
    if durability.replicas:
        raise ValueError(f"min_replicas: {durability.replicas} (from the URL or "
                         f"${MIN_REPLICAS_ENV}): durable writes (WAIT) are not supported on a "
                         "Redis Cluster; use 0")
    return RedisTarget(url="", durability=durability, cluster=cluster)


def parse_redis_url(url: str) -> RedisTarget:
    """Read a plain URL (redis://, rediss://, unix://) or a Sentinel one:
    `redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/<service>[/<db>][?...]`
    (port 26379 by default). The password is the data nodes'; the query may carry
    `sentinel_password`, `min_replicas`, `wait_timeout_ms` and redis-py's connection options
    (`socket_timeout`, ...). Raises ValueError saying what is wrong."""
    if is_cluster_url(url):
        return _cluster_target(url)
    parts = urlsplit(url)
    params = dict(parse_qsl(parts.query, keep_blank_values=True))
    if parts.scheme != SENTINEL_SCHEME:
        ours = {k: params[k] for k in DURABILITY_PARAMS if k in params}
        plain = url if not ours else urlunsplit(parts._replace(query=urlencode(
            [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True)
             if k not in DURABILITY_PARAMS])))
        parse_url(plain)
        return RedisTarget(url=plain, durability=_durability(ours, sentinel=False))
    userinfo, _, netloc = parts.netloc.rpartition("@")
    if not netloc:
        raise ValueError("no sentinel address (redis+sentinel://host:26379,.../service)")
    sentinels = _sentinel_hosts(netloc)
    path = [unquote(p) for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ValueError("the path must be /<service name> or /<service name>/<db>")
    options: dict[str, Any] = {}
    if len(path) == 2:
        options["db"] = _whole("db", path[1], 0)
    user, _, password = userinfo.partition(":")
    if user:
        options["username"] = unquote(user)
    if password:
        options["password"] = unquote(password)
    sentinel_options: dict[str, Any] = {}
    for name, value in params.items():
        if name in DURABILITY_PARAMS:
            continue
        if name == "sentinel_password":
            sentinel_options["password"] = value
            continue
        parser = URL_QUERY_ARGUMENT_PARSERS.get(name)
        if parser is None or name == "retry_on_error":
            raise ValueError(f"unknown parameter {name!r}")
        try:
            options[name] = parser(value)
        except (TypeError, ValueError):
            raise ValueError(f"parameter {name}: {value!r} is not valid") from None
    return RedisTarget(url="", durability=_durability(params, sentinel=True),
                       sentinels=sentinels, service=path[0], options=options,
                       sentinel_options=sentinel_options)


def durability(url: str) -> Durability:
    """How durable writes through `url` must be (see `parse_redis_url`)."""
    return parse_redis_url(url).durability


_SINGLE_ATTEMPT: ContextVar[bool] = ContextVar("rb_single_attempt", default=False)


@contextmanager
def single_attempt() -> Iterator[None]:
    """Within it (this thread or asyncio task), a command whose connection fails is not sent
    again by redis-py: the error reaches the caller (see the module docstring)."""
    token = _SINGLE_ATTEMPT.set(True)
    try:
        yield
    finally:
        _SINGLE_ATTEMPT.reset(token)


def _retry_allowed(_error: Exception) -> bool:
    return not _SINGLE_ATTEMPT.get()


class _Retry(Retry):
    """redis-py's Retry, off within `single_attempt()`: connections call it through
    `is_retryable`, a cluster client asks `get_retries()` (each connection holds a deep copy,
    so the switch lives outside the object)."""

    def __init__(self, backoff_: Any, retries: int) -> None:
        super().__init__(backoff_, retries, is_retryable=_retry_allowed)

    def get_retries(self) -> int:
        return super().get_retries() if _retry_allowed(None) else 0


class _AsyncRetry(AsyncRetry):
    """`_Retry` for asyncio clients."""

    def __init__(self, backoff_: Any, retries: int) -> None:
        super().__init__(backoff_, retries, is_retryable=_retry_allowed)

    def get_retries(self) -> int:
        return super().get_retries() if _retry_allowed(None) else 0


def backoff() -> ExponentialWithJitterBackoff:
    return ExponentialWithJitterBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S)


def _redacted(url: str) -> str:
    """`url` with any password in it replaced by ***, for messages."""
    head, at, tail = url.partition("@")
    scheme, sep, userinfo = head.rpartition("//")
    if not at or not sep or ":" not in userinfo:
        return url
    return f"{scheme}//{userinfo.partition(':')[0]}:***@{tail}"


def check_redis_url(url: str, field: str = "redis_url") -> None:
    """Raise ValueError("<field>: ...") for a URL no Redis client could use (checked before a
    process starts anything; an unreachable server is an outage, waited out, not this)."""
    try:
        parse_redis_url(url)
    except ValueError as exc:
        if str(exc).startswith(MIN_REPLICAS_ENV):
            raise ValueError(str(exc)) from None
        raise ValueError(f"{field}: {_redacted(url)!r}: {exc} (e.g. {DEFAULT_REDIS_URL}, or "
                         f"{SENTINEL_SCHEME}://host1:26379,host2:26379/<service>, or "
                         "redis+cluster://host1:6379,host2:6379)") from None


def _options(retry: Retry | AsyncRetry, kwargs: dict) -> dict:
    opts = dict(retry=retry, retry_on_error=[BusyLoadingError], socket_timeout=SOCKET_TIMEOUT_S,
                socket_connect_timeout=CONNECT_TIMEOUT_S, socket_keepalive=True,
                health_check_interval=30)
    opts.update(kwargs)
    return opts


class _SentinelConnection(redis.sentinel.SentinelManagedConnection):
    """redis-py's connection to the primary the sentinels name, closed when a read is cut
    short (an exception from a signal handler: RQ's SIGTERM) as a plain connection is. redis-py
    8.1's keeps it open by default, so the next command read the old command's reply: a tool
    worker stopped with SIGTERM hung on its last write behind its pending BLPOP."""

    def read_response(self, disable_decoding=False, *, disconnect_on_error=True, **kwargs):
        try:
            return super().read_response(disable_decoding,
                                         disconnect_on_error=disconnect_on_error, **kwargs)
        except redis.ResponseError as exc:
            # The primary was demoted between a durable write and its WAIT: as redis-py does
            # for READONLY, drop the connection so the next one asks the sentinels again.
            if WAIT_ON_REPLICA in str(exc) and self.connection_pool.is_master:
                self.disconnect()
                raise redis.ConnectionError("the primary is now a replica (WAIT refused)") from exc
            raise


def _sentinel_options(target: RedisTarget, opts: dict, retry: Retry | AsyncRetry) -> dict:
    """The sentinels' own clients: quick to give up on one sentinel (the next is asked)."""
    out = {"socket_timeout": opts["socket_connect_timeout"],
           "socket_connect_timeout": opts["socket_connect_timeout"], "socket_keepalive": True,
           "retry": retry}
    out.update(target.sentinel_options)
    return out


def connect(url: str, **kwargs) -> redis.Redis:
    """A client for `url` that retries connection errors and timeouts a few times itself;
    with a Sentinel URL, one of the service's current primary."""
    target = parse_redis_url(url)
    opts = _options(_Retry(backoff(), CONNECTION_RETRIES), {**target.options, **kwargs})
    if target.cluster is not None:
        return cluster_client(target.cluster, **opts)
    if not target.sentinel:
        return redis.Redis.from_url(target.url, **opts)
    sentinel = redis.sentinel.Sentinel(
        target.sentinels, sentinel_kwargs=_sentinel_options(target, opts, Retry(NoBackoff(), 0)))
    return sentinel.master_for(target.service, connection_class=_SentinelConnection, **opts)


def connect_async(url: str, **kwargs) -> aioredis.Redis:
    """`connect`'s client for asyncio (it connects on first use)."""
    target = parse_redis_url(url)
    opts = _options(_AsyncRetry(backoff(), CONNECTION_RETRIES), {**target.options, **kwargs})
    if target.cluster is not None:
        return cluster_client_async(target.cluster, **opts)
    if not target.sentinel:
        return aioredis.Redis.from_url(target.url, **opts)
    sentinel = aiosentinel.Sentinel(
        target.sentinels,
        sentinel_kwargs=_sentinel_options(target, opts, AsyncRetry(NoBackoff(), 0)))
    return sentinel.master_for(target.service, **opts)


def delete_namespace(client: redis.Redis, prefix: str, batch: int = 1000) -> int:
    """Delete every key under `prefix` (a namespace's `Keys.prefix`, `rb:{ns}:`), UNLINKed in
    batches; returns how many. For a Redis shared with others: nothing outside it is touched,
    and one hash tag holds the batch in one slot of a Redis Cluster."""
    if not (prefix.startswith("rb:{") and prefix.endswith("}:")):
        raise ValueError(f"prefix: {prefix!r} is not a namespace's key prefix (rb:{{ns}}:)")
    done, keys = 0, []
    for key in client.scan_iter(match=f"{prefix}*", count=batch):
        keys.append(key)
        if len(keys) >= batch:
            done += client.unlink(*keys)
            keys = []
    if keys:
        done += client.unlink(*keys)
    return done


def is_outage(exc: BaseException) -> bool:
    if isinstance(exc, OUTAGE_ERRORS):
        return True
    # Inside a Lua script, a write refused for memory arrives as a plain script error.
    return isinstance(exc, redis.ResponseError) and any(r in str(exc) for r in OUTAGE_REPLIES)


def describe_outage(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class Outage:
    """One loop's view of Redis being down: logs once per outage, paces the retries."""

    def __init__(self, what: str, log: logging.Logger) -> None:
        self.what = what
        self.log = log
        self._lock = threading.Lock()
        self._since: float | None = None
        self._failures = 0
        self._backoff = backoff()

    @property
    def ongoing(self) -> bool:
        return self._since is not None

    def failed(self, exc: BaseException) -> float:
        """Record a failed try; returns the seconds to wait before the next one."""
        with self._lock:
            if self._since is None:
                self._since = time.monotonic()
                self._failures = 0
                self.log.warning("%s: redis unavailable (%s); retrying until it answers",
                                 self.what, describe_outage(exc))
            self._failures += 1
            # Past the cap the count only grows; 2**count would overflow a float after 1023
            # failures (a trainer polling through a long outage gets there in minutes).
            return self._backoff.compute(min(self._failures, 64))

    def ok(self) -> None:
        """Record a successful call; logs the end of an outage."""
        if self._since is None:
            return
        with self._lock:
            if self._since is None:
                return
            self.log.warning("%s: redis answers again after %.1fs", self.what,
                             time.monotonic() - self._since)
            self._since = None

    def call(self, fn: Callable[..., T], *args, stop: threading.Event | None = None,
             deadline: float | None = None, **kwargs) -> T:
        """`fn(*args, **kwargs)`, tried again after each outage error until it succeeds.

        Raises the last error when `stop` is set or the monotonic `deadline` passes first."""
        while True:
            try:
                out = fn(*args, **kwargs)
            except Exception as exc:
                if not is_outage(exc):
                    raise
                wait = self.failed(exc)
                if deadline is not None and time.monotonic() + wait > deadline:
                    raise
                if stop is not None:
                    if stop.wait(wait):
                        raise
                else:
                    time.sleep(wait)
                continue
            self.ok()
            return out
