"""RolloutClient: validation, mixture, results exactly once across restarts, quota, asyncio."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from broker.client import AsyncRolloutClient, RolloutClient, _Plans, quotas
from broker.heartbeat import EngineMetrics
from broker.keys import Keys
from broker.plans import Runner
from broker.session import SessionResult, SessionState
from broker.weights import order_pause, wait_paused
from broker.worker_link import WorkerLink
from tests.broker.helpers import make_session


@pytest.fixture
def client(redis_url, namespace, redis_client):
    c = RolloutClient(redis_url, namespace)
    yield c
    c.close()


@pytest.mark.parametrize("item, field", [
    ({"session_id": "a", "workload": "nope", "prompt_text": "hi", "max_tokens": 4}, "workload"),
    ({"session_id": "a", "workload": "rlvr", "prompt_text": "", "max_tokens": 4}, "prompt"),
    ({"session_id": "a", "workload": "rlvr", "prompt_text": "hi", "max_tokens": 0}, "max_tokens"),
    ({"session_id": "a", "workload": "rlvr", "prompt_token_ids": list(range(600)),
      "max_tokens": 4}, "prompt_token_ids"),
    ({"session_id": "a", "workload": "rlvr", "prompt_token_ids": [5, -1],
      "max_tokens": 4}, r"prompt_token_ids\.1"),
])
def test_bad_item_rejects_the_whole_batch_naming_item_and_field(client, redis_url, namespace,
                                                                 item, field):
    WorkerLink(redis_url, namespace, "b0").register(10_000, 512)
    good = make_session(1).model_dump()
    with pytest.raises(ValueError, match=rf"sessions\[1\]\.{field}"):
        client.enqueue([good, item])
    assert client.status()["pending"]["rlvr"] == 0  # nothing half-enqueued


def test_an_item_that_is_not_an_object_is_named_by_its_index(client):
    with pytest.raises(ValueError, match=r"^sessions\[1\]: Input should be a valid dictionary"):
        client.enqueue([make_session(1), 5])


def test_enqueue_returns_only_new_ids(client):
    assert client.enqueue([make_session(1), make_session(2)]) == ["s1", "s2"]
    assert client.enqueue([make_session(2), make_session(3)]) == ["s3"]


@pytest.mark.parametrize("mixture, field", [
    ({"rlvr": 0.5, "nope": 0.5}, "mixture.nope"),
    ({"rlvr": -0.1, "rlhf": 1.1}, "mixture.rlvr"),
    ({"rlvr": 0.5, "rlhf": 0.4}, "mixture"),
    ({}, "mixture"),
])
def test_set_mixture_validates(client, mixture, field):
    with pytest.raises(ValueError, match=rf"^{field}"):
        client.set_mixture(mixture)


def test_quotas_sum_to_the_batch():
    assert quotas(10, {"a": 0.5, "b": 0.25, "c": 0.25}) == {"a": 5, "b": 3, "c": 2}
    assert sum(quotas(7, {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}).values()) == 7


def publish(redis_url, namespace, redis_client, n: int, workloads=("rlvr",),
            groups: dict[int, tuple[str, int]] | None = None,
            order: list[int] | None = None) -> None:
    """Put n finished sessions on the results stream through the real scripts (session i of
    `groups` in group (id, size); finished in `order`, default by index)."""
    from broker.heartbeat import EngineMetrics
    from broker.keys import BROKER_GROUP
    from broker.scripts import Scripts
    k = Keys(namespace)
    link = WorkerLink(redis_url, namespace, "b0", heartbeat_ttl_s=60)
    link.register(10**9, 4096)
    link.heartbeat(EngineMetrics(kv_usage=0, running=0, waiting=0, preemptions_total=0,
                                 prefix_queries_total=0, prefix_hits_total=0))
    c = RolloutClient(redis_url, namespace)
    sessions = [make_session(i, workload=workloads[i % len(workloads)]) for i in range(n)]
    c.enqueue(sessions)
    redis_client.set(k.lease, "T")
    s = Scripts(redis_client)
    for w in set(workloads):
        redis_client.xgroup_create(k.pending(w), BROKER_GROUP, id="0")
        for eid, f in redis_client.xreadgroup(BROKER_GROUP, "c", {k.pending(w): ">"})[0][1]:
            sid = f[b"sid"].decode()
            s.admit(keys=[k.lease, k.session(sid), k.ledger("b0"), k.ledger_sessions("b0"),
                          k.heartbeat("b0"), k.admitted("b0"), k.pending(w)],
                    args=["T", sid, "b0", 10, eid, "1.0", "1"])
    for i in order if order is not None else range(n):
        x = sessions[i]
        gid, size = (groups or {}).get(i, (None, 1))
        assert link.finish(SessionResult(session_id=x.session_id, workload=x.workload,
                                         group_id=gid, group_size=size,
                                         status=SessionState.done)) == "ok"


def test_results_exactly_once_across_client_restarts(redis_url, namespace, redis_client):
    publish(redis_url, namespace, redis_client, 30)
    a = RolloutClient(redis_url, namespace)
    first = a.results(10, timeout=2)
    a._client.close()  # crash: the batch was handed back but never acked
    b = RolloutClient(redis_url, namespace)
    again = b.results(10, timeout=2)
    assert [r.session_id for r in again] == [r.session_id for r in first]
    rest = b.results(20, timeout=2)  # acks `again` first
    b.close()  # acks `rest`
    c = RolloutClient(redis_url, namespace)
    assert c.results(5, timeout=0.3) == []
    ids = [r.session_id for r in again + rest]
    assert len(ids) == 30 and len(set(ids)) == 30
    assert c.status()["consumed"] == {"rlvr": 30}
    c.close()


def test_by_group_delivers_whole_groups_in_the_order_they_complete(redis_url, namespace,
                                                                   redis_client):
    groups = {0: ("A", 3), 1: ("A", 3), 2: ("A", 3), 3: ("B", 2), 4: ("B", 2),
              5: ("C", 4), 6: ("C", 4), 7: ("C", 4), 8: ("C", 4)}  # 9: no group
    # Finish order: A, B, C interleaved; B completes first, then A; C's last member is last.
    publish(redis_url, namespace, redis_client, 10, groups=groups,
            order=[0, 3, 5, 1, 4, 6, 2, 9, 7, 8])
    c = RolloutClient(redis_url, namespace)
    first = c.results(4, by_group=True, timeout=2)
    assert [r.session_id for r in first] == ["s3", "s4"]  # B; A (3 more) would not fit in 4
    second = c.results(4, by_group=True, timeout=2)
    assert [r.session_id for r in second] == ["s0", "s1", "s2", "s9"]  # A, then the singleton
    third = c.results(2, by_group=True, timeout=2)
    assert [r.session_id for r in third] == ["s5", "s6", "s7", "s8"]  # larger than 2: alone
    with pytest.raises(ValueError, match="by_group"):
        c.results(4, mode="quota", by_group=True)
    c.close()


def test_by_group_holds_back_a_group_until_its_last_member_finishes(redis_url, namespace,
                                                                    redis_client):
    groups = {0: ("G", 3), 1: ("G", 3), 2: ("G", 3)}
    publish(redis_url, namespace, redis_client, 3, groups=groups, order=[0, 1])
    c = RolloutClient(redis_url, namespace)
    assert c.results(3, by_group=True, timeout=0.5) == []
    assert [r.session_id for r in c.results(3, timeout=0.5)] == ["s0", "s1"]  # fifo: no wait
    c.close()


def test_quota_mode_follows_the_mixture(redis_url, namespace, redis_client):
    publish(redis_url, namespace, redis_client, 40, workloads=("rlvr", "rlhf"))
    c = RolloutClient(redis_url, namespace)
    c.set_mixture({"rlvr": 0.75, "rlhf": 0.25})
    batch = c.results(8, mode="quota", timeout=2)
    assert sorted(r.workload for r in batch) == ["rlhf"] * 2 + ["rlvr"] * 6
    c.close()


def test_async_client_has_the_same_methods(redis_url, namespace, redis_client):
    publish(redis_url, namespace, redis_client, 5)

    async def main():
        async with AsyncRolloutClient(redis_url, namespace) as ac:
            assert await ac.enqueue([make_session(99)]) == ["s99"]
            await ac.set_mixture({"rlvr": 1.0})
            got = await ac.results(5, timeout=2)
            assert await ac.cancel("s99") == "cancelled"
            st = await ac.status()
            return got, st
    got, st = asyncio.run(main())
    assert len({r.session_id for r in got}) == 5
    assert st["mixture"] == {"rlvr": 1.0}


def test_a_waiting_results_call_never_holds_up_enqueue_or_status(redis_url, namespace,
                                                                  redis_client):
    """An empty namespace: `results` waits its whole timeout. `enqueue`, `status` and `pause`
    run meanwhile and return while it still waits (one lock for every call held them back
    for the whole wait)."""
    async def main():
        async with AsyncRolloutClient(redis_url, namespace) as ac:
            waiting = asyncio.create_task(ac.results(5, timeout=8.0))
            await asyncio.sleep(0.2)  # it is inside its blocking read now
            assert await ac.enqueue([make_session(1)]) == ["s1"]
            assert (await ac.status())["pending"]["rlvr"] == 1
            assert await ac.pause("keep", timeout=1.0) == []  # no worker: nothing to wait for
            assert not waiting.done()
            return await waiting
    assert asyncio.run(main()) == []


def test_stream_yields_batch_after_batch(redis_url, namespace, redis_client):
    publish(redis_url, namespace, redis_client, 7)
    c = RolloutClient(redis_url, namespace)
    got: list[list[SessionResult]] = []
    try:
        for batch in c.stream(3, timeout=2.0):
            got.append(batch)
            if sum(map(len, got)) == 7:
                break
    finally:
        c.close()
    assert [len(b) for b in got] == [3, 3, 1]  # the last: what was left after its timeout
    assert len({r.session_id for b in got for r in b}) == 7


def test_the_async_stream_yields_batch_after_batch(redis_url, namespace, redis_client):
    publish(redis_url, namespace, redis_client, 4)

    async def main():
        async with AsyncRolloutClient(redis_url, namespace) as ac:
            got = []
            async for batch in ac.stream(2, timeout=2.0):
                got.append([r.session_id for r in batch])
                if sum(map(len, got)) == 4:
                    return got
    got = asyncio.run(main())
    assert [len(b) for b in got] == [2, 2] and len({s for b in got for s in b}) == 4


@pytest.mark.parametrize("item, field", [
    ({"prompt_token_ids": [True, False]}, r"prompt_token_ids\.0: Input should be a valid integer"),
    ({"max_tokens": "10"}, "max_tokens: Input should be a valid integer"),
    ({"max_turns": 2.0}, "max_turns: Input should be a valid integer"),
    ({"metadata": {"x": float("nan")}}, "metadata.x: nan is not a finite number"),
    ({"metadata": {"x": float("inf")}}, "metadata.x: inf is not a finite number"),
    ({"metadata": {"x": [1, 2]}}, "metadata.x: must be a string, number or boolean"),
    ({"metadata": {"reward": "sys:exit"}}, "metadata.reward: 'sys:exit' is not a registry key"),
    ({"metadata": {"tool": "os:system"}}, "metadata.tool: 'os:system' is not a registry key"),
    ({"max_turns": 3}, "metadata.tool: a session of max_turns 3 needs a tool"),
    ({"sampling": {"temperature": "1"}}, r"sampling\.temperature: Input should be a valid number"),
])
def test_loose_input_is_refused_naming_the_field(client, item, field):
    bad = {**make_session(2).model_dump(), **item}
    with pytest.raises(ValueError, match=rf"^sessions\[1\]\.{field}"):
        client.enqueue([make_session(1), bad])
    assert client.status()["pending"]["rlvr"] == 0


def test_one_id_twice_with_different_bodies_refuses_the_batch(client):
    other = make_session(1).model_copy(update={"max_tokens": 99})
    with pytest.raises(ValueError, match=r"^sessions\[2\]\.session_id: 's1' is also sessions\[0\]"):
        client.enqueue([make_session(1), make_session(2), other])
    assert client.status()["pending"]["rlvr"] == 0
    assert client.enqueue([make_session(1), make_session(1)]) == ["s1"]  # the same one: kept once


def test_token_ids_beyond_a_reported_vocabulary_are_refused_at_enqueue(client, redis_url, namespace):
    link = WorkerLink(redis_url, namespace, "b0")
    link.register(10_000, 4096)  # reports no vocabulary: nothing to judge against
    assert client.enqueue([make_session(1).model_copy(update={"prompt_token_ids": [5, 50_000]})])
    link.register(10_000, 4096, vocab_size=32_000)
    WorkerLink(redis_url, namespace, "b1").register(10_000, 4096, vocab_size=128_000)
    with pytest.raises(ValueError, match=r"^sessions\[0\]\.prompt_token_ids: token id 32000 is "
                                         r"not below the served vocabulary size 32000"):
        client.enqueue([make_session(2).model_copy(update={"prompt_token_ids": [1, 32_000]})])
    assert client.enqueue([make_session(3).model_copy(update={"prompt_token_ids": [31_999]})])


def test_a_malformed_results_entry_goes_to_the_dead_letters_and_the_rest_arrive(
        client, redis_url, namespace, redis_client):
    link = WorkerLink(redis_url, namespace, "b0")
    k = Keys(namespace)
    good = [SessionResult(session_id=f"s{i}", workload="rlvr", status=SessionState.done)
            for i in range(3)]
    redis_client.xadd(k.results, {"sid": "s0", "result": good[0].model_dump_json()})
    redis_client.xadd(k.results, {"sid": "x", "result": "{not json"})
    redis_client.xadd(k.results, {"sid": "y", "status": "done"})  # no result field at all
    for r in good[1:]:
        redis_client.xadd(k.results, {"sid": r.session_id, "result": r.model_dump_json()})
    got = client.results(10, timeout=1.0)
    assert [r.session_id for r in got] == ["s0", "s1", "s2"]
    client.ack()
    dead = redis_client.xrange(k.dead_letter)
    assert [f[b"f:sid"] for _, f in dead] == [b"x", b"y"]
    assert dead[0][1][b"reason"].startswith(b"result does not validate")
    assert dead[1][1][b"reason"] == b"entry has no 'result' field"
    # nothing is left unacknowledged, so a restarted trainer does not trip on them again
    assert redis_client.xpending(k.results, "trainer")["pending"] == 0
    again = RolloutClient(redis_url, namespace)
    assert again.results(10, timeout=0.3) == []
    again.close()
    link.close()


def test_acknowledging_twice_counts_once(client, redis_url, namespace, redis_client):
    k = Keys(namespace)
    r = SessionResult(session_id="s0", workload="rlvr", status=SessionState.done)
    redis_client.xadd(k.results, {"sid": "s0", "result": r.model_dump_json()})
    [got] = client.results(1, timeout=1.0)
    handed = list(client._handed)
    client.ack()
    client._handed = handed  # the same acknowledgement again, as after a lost reply
    client.ack()
    assert client.status()["consumed"] == {"rlvr": 1}


def beating_worker(redis_url: str, namespace: str, backend: str) -> WorkerLink:
    """A registered backend whose heartbeat is live for 30 s (it pauses when a test says)."""
    link = WorkerLink(redis_url, namespace, backend, heartbeat_ttl_s=30.0)
    link.register(4000, 32768)
    link.heartbeat(EngineMetrics(kv_usage=0.0, running=0, waiting=0, preemptions_total=0,
                                 prefix_queries_total=0, prefix_hits_total=0))
    return link


def test_pause_ends_when_the_last_worker_acknowledges_not_at_its_next_look(
        redis_url, namespace, redis_client):
    """`pause` blocks on the stream of acknowledgements between its looks at the workers: with
    a look due only every 4 s, a worker acknowledging after 0.3 s ends the wait at once."""
    keys = Keys(namespace)
    link = beating_worker(redis_url, namespace, "b0")
    runner = Runner(redis_client)
    epoch = runner.run(order_pause(keys, "keep"))
    acker = threading.Timer(0.3, link.ack_paused, args=(epoch,))
    t0 = time.monotonic()
    acker.start()
    try:
        assert runner.run(wait_paused(keys, epoch, timeout_s=20.0, recheck_s=4.0)) == ["b0"]
        waited = time.monotonic() - t0
    finally:
        acker.cancel()
        link.close()
    assert 0.3 <= waited < 3.0, waited


def test_pause_stops_waiting_for_a_worker_that_dies_during_it(redis_url, namespace,
                                                              redis_client):
    """A worker whose heartbeat goes away during the wait leaves no entry on the stream; the
    wait reads the live workers again after `recheck_s` without one and returns the others."""
    keys = Keys(namespace)
    links = [beating_worker(redis_url, namespace, b) for b in ("b0", "b1")]
    runner = Runner(redis_client)
    epoch = runner.run(order_pause(keys, "keep"))
    timers = [threading.Timer(0.1, links[0].ack_paused, args=(epoch,)),
              threading.Timer(0.3, links[1].withdraw)]  # b1 goes away without pausing
    t0 = time.monotonic()
    for t in timers:
        t.start()
    try:
        assert runner.run(wait_paused(keys, epoch, timeout_s=10.0, recheck_s=0.5)) == ["b0"]
        waited = time.monotonic() - t0
    finally:
        for t in timers:
            t.cancel()
        for link in links:
            link.close()
    assert waited < 3.0, waited


def test_the_async_pause_returns_once_the_worker_acknowledges(redis_url, namespace,
                                                              redis_client):
    """The same wait on the asyncio client (its blocking read on a pooled connection)."""
    link = beating_worker(redis_url, namespace, "b0")

    async def main():
        async with AsyncRolloutClient(redis_url, namespace) as ac:
            acker = threading.Timer(0.3, lambda: link.ack_paused(
                int(redis_client.hget(Keys(namespace).weights, "epoch"))))
            acker.start()
            try:
                return await ac.pause("keep", timeout=10.0)
            finally:
                acker.cancel()

    try:
        assert asyncio.run(main()) == ["b0"]
    finally:
        link.close()


def _served(plan, reply):
    """Run a plan whose one step is a single read, answering it with `reply`."""
    next(plan)
    try:
        plan.send(reply)
    except StopIteration as done:
        return done.value
    raise AssertionError("the plan asked for more than one step")


def test_an_entry_the_client_holds_enters_its_buffer_once_whatever_read_delivers_it():
    """A new primary that lacks a delivery (see broker.plans.durable) hands the entry to a
    '>' read again: it must not be buffered, and so handed back, twice."""
    plans = _Plans("ns", None, "trainer", 1.0)
    result = SessionResult(session_id="s0", workload="rlvr", status=SessionState.done)
    reply = [[b"rb:{ns}:results", [(b"5-0", {b"result": result.model_dump_json().encode()})]]]
    assert _served(plans._fetch(100, 1000), reply) == 1  # the backlog read: it is new
    assert plans._cursor.read_args(1000)[0] == ">"
    assert _served(plans._fetch(100, 1000), reply) == 0  # '>' delivers it again
    assert [r.session_id for r in plans._take(10, None)] == ["s0"]
    assert _served(plans._fetch(100, 1000), reply) == 0  # handed back, not yet acknowledged
    assert plans._take(10, None) == []
