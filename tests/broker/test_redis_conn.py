"""Outage: the retry loop every process uses while Redis is down (pure; no server needed)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import redis

from broker.redis_conn import Outage, connect, is_outage

log = logging.getLogger("test.outage")


class Flaky:
    """Fails with `exc` the first `failures` calls, then answers."""

    def __init__(self, failures: int, exc: Exception) -> None:
        self.failures = failures
        self.exc = exc
        self.calls = 0

    def __call__(self, value: str = "ok") -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.exc
        return value


def test_an_outage_is_logged_once_and_its_end_once(caplog):
    outage = Outage("unit", log)
    flaky = Flaky(5, redis.ConnectionError("Error 111 connecting to 127.0.0.1:1. refused"))
    with caplog.at_level(logging.WARNING, logger="test.outage"):
        assert outage.call(flaky, "fine") == "fine"
        assert outage.call(flaky, "again") == "again"  # no outage: nothing logged
    assert flaky.calls == 7
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("unit: redis unavailable (ConnectionError") and "retrying" in lines[0]
    assert lines[1].startswith("unit: redis answers again after")


@pytest.mark.parametrize("exc", [
    redis.ConnectionError("refused"), redis.TimeoutError("timed out"),
    redis.exceptions.BusyLoadingError("LOADING Redis is loading the dataset in memory"),
    redis.exceptions.OutOfMemoryError("OOM command not allowed when used memory > 'maxmemory'"),
    redis.ResponseError("Error running script (call to f_x): @user_script:12: OOM command not "
                        "allowed when used memory > 'maxmemory'."),
    redis.exceptions.ReadOnlyError("READONLY You can't write against a read only replica."),
    redis.exceptions.NoScriptError("NOSCRIPT No matching script."),
])
def test_what_counts_as_an_outage(exc):
    assert is_outage(exc)


@pytest.mark.parametrize("exc", [redis.ResponseError("WRONGTYPE Operation against a key"),
                                 ValueError("a bug"), redis.exceptions.DataError("bad arg")])
def test_a_wrong_command_is_not_an_outage_and_is_raised_at_once(exc):
    flaky = Flaky(1, exc)
    with pytest.raises(type(exc)):
        Outage("unit", log).call(flaky)
    assert flaky.calls == 1
    assert not is_outage(exc)


def test_the_deadline_and_the_stop_event_end_the_wait():
    never = Flaky(10**9, redis.ConnectionError("refused"))
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        Outage("unit", log).call(never, deadline=time.monotonic() + 0.3)
    assert time.monotonic() - started < 5
    stop = threading.Event()
    stop.set()
    with pytest.raises(redis.ConnectionError):
        Outage("unit", log).call(never, stop=stop)


def test_the_wait_between_tries_is_capped_so_recovery_is_quick():
    outage = Outage("unit", log)
    waits = [outage.failed(redis.ConnectionError("refused")) for _ in range(50)]
    assert max(waits) <= 0.5


def test_connect_uses_a_bounded_retry_and_timeouts():
    client = connect("redis://127.0.0.1:1/0")
    kw = client.connection_pool.connection_kwargs
    assert kw["socket_connect_timeout"] <= 2 and kw["socket_timeout"] is not None
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError):  # nothing listens on port 1
        client.ping()
    assert time.monotonic() - started < 5  # a few quick retries, then the caller's loop decides
    client.close()
