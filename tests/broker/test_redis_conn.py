"""Outage: the retry loop every process uses while Redis is down (pure; no server needed)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import redis

from broker.redis_conn import (
    MIN_REPLICAS_ENV,
    NO_WAIT,
    Durability,
    NotReplicatedError,
    Outage,
    check_redis_url,
    connect,
    durability,
    is_outage,
    parse_redis_url,
    single_attempt,
)

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
    # Thousands of failures (calls that give up at their deadline without waiting) do not
    # overflow the backoff's 2**n.
    assert max(outage.failed(redis.ConnectionError("refused")) for _ in range(5000)) <= 0.5


def test_connect_uses_a_bounded_retry_and_timeouts():
    client = connect("redis://127.0.0.1:1/0")
    kw = client.connection_pool.connection_kwargs
    assert kw["socket_connect_timeout"] <= 2 and kw["socket_timeout"] is not None
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError):  # nothing listens on port 1
        client.ping()
    assert time.monotonic() - started < 5  # a few quick retries, then the caller's loop decides
    client.close()


def test_a_single_attempt_is_not_retried_by_redis_py_but_other_commands_are():
    """A read that delivers (XREADGROUP '>') must not be sent again after a lost reply: the
    connections' retry (call_with_retry) and a cluster client's (get_retries) are off inside
    `single_attempt()`, and only there."""
    retry = connect("redis://127.0.0.1:1/0").connection_pool.connection_kwargs["retry"]
    flaky = Flaky(1, redis.ConnectionError("reset"))
    assert retry.call_with_retry(flaky, lambda _: None) == "ok" and flaky.calls == 2
    assert retry.get_retries() >= 1
    flaky = Flaky(1, redis.ConnectionError("reset"))
    with single_attempt():
        assert retry.get_retries() == 0
        with pytest.raises(redis.ConnectionError):
            retry.call_with_retry(flaky, lambda _: None)
    assert flaky.calls == 1
    assert retry.get_retries() >= 1  # (and on again once the block ends)


def test_a_sentinel_url_names_the_sentinels_the_service_and_the_data_nodes_options():
    t = parse_redis_url("redis+sentinel://:s3cret@h1:26380,h2,[::1]:26381/rb/2"
                        "?socket_timeout=4&sentinel_password=sp&wait_timeout_ms=500")
    assert t.sentinel and t.service == "rb"
    assert t.sentinels == (("h1", 26380), ("h2", 26379), ("::1", 26381))
    assert t.options == {"db": 2, "password": "s3cret", "socket_timeout": 4.0}
    assert t.sentinel_options == {"password": "sp"}
    assert t.durability == Durability(replicas=1, timeout_ms=500)  # Sentinel: wait for one


def test_durable_writes_wait_for_replicas_only_when_asked(monkeypatch):
    monkeypatch.delenv(MIN_REPLICAS_ENV, raising=False)
    assert durability("redis://127.0.0.1:6379/0") == NO_WAIT  # plain Redis: nothing changes
    plain = parse_redis_url("redis://h:1/0?min_replicas=2&socket_timeout=3")
    assert plain.url == "redis://h:1/0?socket_timeout=3"  # ours are not redis-py's
    assert plain.durability.replicas == 2
    monkeypatch.setenv(MIN_REPLICAS_ENV, "0")
    assert durability("redis+sentinel://h/rb").replicas == 0
    assert durability("redis+sentinel://h/rb?min_replicas=3").replicas == 3  # the URL wins
    monkeypatch.setenv(MIN_REPLICAS_ENV, "two")
    with pytest.raises(ValueError, match=f"^{MIN_REPLICAS_ENV}: 'two' must be a whole number"):
        check_redis_url("redis+sentinel://h/rb")


@pytest.mark.parametrize(("url", "why"), [
    ("redis+sentinel://h1:26379", "the path must be /<service name>"),
    ("redis+sentinel:///rb", "no sentinel address"),
    ("redis+sentinel://h1:port/rb", "sentinel h1 port: 'port' must be a whole number"),
    ("redis+sentinel://h1/rb?colour=blue", "unknown parameter 'colour'"),
    ("redis+sentinel://h1/rb?min_replicas=-1", "min_replicas: '-1' must be a whole number"),
    ("redis+sentinel://h1/rb?wait_timeout_ms=0", "wait_timeout_ms: '0' must be a whole number"),
    ("redis+sentinel://:pw@h1/rb/x", "db: 'x' must be a whole number"),
])
def test_a_bad_sentinel_url_is_one_line_naming_the_field(url, why):
    with pytest.raises(ValueError) as err:
        check_redis_url(url, field="redis_url")
    msg = str(err.value)
    assert msg.startswith("redis_url: ") and why in msg and "\n" not in msg
    assert "pw" not in msg  # a password is never echoed


def test_failover_errors_count_as_outages():
    from redis.sentinel import MasterNotFoundError

    for exc in (MasterNotFoundError("No master found for 'rb'"), NotReplicatedError("0 of 1"),
                redis.exceptions.ReadOnlyError("READONLY You can't write against a replica."),
                redis.ConnectionError("The previous master is now a slave"),
                redis.ResponseError("NOREPLICAS Not enough good replicas to write."),
                redis.ResponseError("Error running script (call to f_3bc5): @user_script:9: "
                                    "@user_script: 9: -READONLY You can't write against a "
                                    "read only replica."),
                redis.ResponseError("UNBLOCKED force unblock from blocking operation, "
                                    "instance state changed (master -> replica?)"),
                redis.ResponseError("Command # 708 (WAIT 1 1000) of pipeline caused error: WAIT "
                                    "cannot be used with replica instances. Please also note "
                                    "that since Redis 4.0 ...")):
        assert is_outage(exc), exc


def test_a_wait_refused_by_a_demoted_primary_drops_the_sentinel_connection(monkeypatch):
    """Writes, then the failover, then the batch's WAIT: the connection is closed and the
    error is a ConnectionError, so redis-py's retry asks the sentinels for the new primary."""
    import redis.sentinel

    from broker.redis_conn import _SentinelConnection

    class Pool:
        is_master = True

    refused = redis.ResponseError("Command # 3 (WAIT 1 1000) of pipeline caused error: WAIT "
                                  "cannot be used with replica instances.")

    def replica_reply(self, *args, **kwargs):
        raise refused

    monkeypatch.setattr(redis.sentinel.SentinelManagedConnection, "read_response", replica_reply)
    conn = _SentinelConnection(connection_pool=Pool())
    dropped = []
    monkeypatch.setattr(conn, "disconnect", lambda *a, **k: dropped.append(True))
    with pytest.raises(redis.ConnectionError, match="now a replica"):
        conn.read_response()
    assert dropped == [True]
    refused = redis.ResponseError("WRONGTYPE Operation against a key")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        conn.read_response()
    assert dropped == [True]
