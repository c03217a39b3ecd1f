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
it; see broker/lua/), so a command that ran but whose reply was lost may run again safely.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis
import redis.asyncio as aioredis
from redis.connection import parse_url
from redis.backoff import ExponentialWithJitterBackoff
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

T = TypeVar("T")

BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 0.5
CONNECTION_RETRIES = 3
SOCKET_TIMEOUT_S = 15.0  # longer than any BLOCK we ask for; bounds a half-open connection
CONNECT_TIMEOUT_S = 2.0

# Errors that mean "Redis is not serving right now", not "this command is wrong":
# unreachable or timed out; loading its data after a restart (BusyLoadingError, a
# ConnectionError); out of memory (writes refused until memory is freed); a replica or a
# primary that lost its replicas during a failover; a script cache emptied by a restart.
OUTAGE_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError, redis.TimeoutError, OutOfMemoryError, ReadOnlyError,
    MasterDownError, TryAgainError, NoScriptError,
)


def backoff() -> ExponentialWithJitterBackoff:
    return ExponentialWithJitterBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S)


def check_redis_url(url: str, field: str = "redis_url") -> None:
    """Raise ValueError("<field>: ...") for a URL no Redis client could use (checked before a
    process starts anything; an unreachable server is an outage, waited out, not this)."""
    try:
        parse_url(url)
    except ValueError as exc:
        raise ValueError(f"{field}: {url!r}: {exc} (e.g. redis://127.0.0.1:6379/0)") from None


def _options(retry: Retry | AsyncRetry, kwargs: dict) -> dict:
    opts = dict(retry=retry, retry_on_error=[BusyLoadingError], socket_timeout=SOCKET_TIMEOUT_S,
                socket_connect_timeout=CONNECT_TIMEOUT_S, socket_keepalive=True,
                health_check_interval=30)
    opts.update(kwargs)
    return opts


def connect(url: str, **kwargs) -> redis.Redis:
    """A client for `url` that retries connection errors and timeouts a few times itself."""
    return redis.Redis.from_url(url, **_options(Retry(backoff(), CONNECTION_RETRIES), kwargs))


def connect_async(url: str, **kwargs) -> aioredis.Redis:
    """`connect`'s client for asyncio (it connects on first use)."""
    return aioredis.Redis.from_url(url, **_options(AsyncRetry(backoff(), CONNECTION_RETRIES),
                                                   kwargs))


def is_outage(exc: BaseException) -> bool:
    if isinstance(exc, OUTAGE_ERRORS):
        return True
    # Inside a Lua script, a write refused for memory arrives as a plain script error.
    return isinstance(exc, redis.ResponseError) and "OOM command not allowed" in str(exc)


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
            return self._backoff.compute(self._failures)

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
