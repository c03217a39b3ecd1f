"""Shared helpers for the broker tests (real Redis)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from broker.service import BrokerService, BrokerSettings
from broker.session import Session
from tests.broker.policies_for_tests import HeadroomPolicy


def make_session(i: int, workload: str = "rlvr", prompt_len: int = 8, max_tokens: int = 16,
                 prefix: str = "s") -> Session:
    return Session(session_id=f"{prefix}{i}", workload=workload,
                   prompt_token_ids=list(range(1, prompt_len + 1)), max_tokens=max_tokens)


def wait_until(cond: Callable[[], bool], timeout: float = 20.0, every: float = 0.02) -> bool:
    """Poll a condition the test waits FOR (not a timing assertion): generous timeouts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every)
    return cond()


class BrokerThread:
    """A BrokerService in a thread of the test process."""

    def __init__(self, redis_url: str, namespace: str, policy=None, lease_s: float = 2.0,
                 **settings) -> None:
        self.service = BrokerService(redis_url, namespace, policy or HeadroomPolicy(),
                                     BrokerSettings(lease_period_s=lease_s, **settings))
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.service.run, args=(self.stop_event,),
                                       daemon=True)

    def start(self) -> BrokerThread:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=15)
        assert not self.thread.is_alive(), "broker thread did not stop"


def published(client, keys) -> int:
    """Results ever published in the namespace: each publish counts `n:<workload>` in the kvsec
    hash (lua/finish.lua, expire.lua, requeue.lua), in the step that publishes it; the stream
    itself keeps only the results not acknowledged yet."""
    return sum(int(v) for f, v in client.hgetall(keys.kv_seconds).items() if f.startswith(b"n:"))


def collect(client, n: int, timeout: float = 60.0) -> list:
    """At least `n` results read from `client` (waiting up to `timeout`), acknowledged."""
    got: list = []
    assert wait_until(lambda: len(got.__iadd__(client.results(n, timeout=0.2)) or got) >= n,
                      timeout=timeout, every=0)
    client.ack()
    return got
