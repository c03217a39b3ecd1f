"""Issue 17: a pending session costs at most 1 KB of Redis. Its body is stored once, in its own key,
as compact JSON with the prompt's token ids packed (broker/body.py); queue entries carry only
the id. Entries and hashes an earlier version wrote (the body in both) are still served."""

from __future__ import annotations

import random

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from broker.body import dump_body, load_body, pack_ids, unpack_ids
from broker.client import RolloutClient
from broker.heartbeat import EngineMetrics
from broker.keys import Keys
from broker.redis_server import start_private_redis
from broker.session import PartialRollout, SamplingParams, Session, TurnRecord
from broker.worker_link import WorkerLink
from tests.broker.helpers import BrokerThread, make_session, wait_until

pytestmark = pytest.mark.timeout(120)

METRICS = EngineMetrics(kv_usage=0.1, running=0, waiting=0, preemptions_total=0,
                        prefix_queries_total=0, prefix_hits_total=0)

# enqueue.lua as the previous version shipped it: the body in the pending entry and the hash.
OLD_ENQUEUE = """
local out = {}
for i = 1, #KEYS / 2 do
  local skey = KEYS[2 * i - 1]
  if redis.call('EXISTS', skey) == 1 then
    out[i] = 0
  else
    local sid, workload, body = ARGV[3 * i - 1], ARGV[3 * i], ARGV[3 * i + 1]
    local id = redis.call('XADD', KEYS[2 * i], '*', 'sid', sid, 'session', body)
    redis.call('HSET', skey, 'state', 'pending', 'workload', workload, 'session', body,
      'enqueued_at', ARGV[1], 'pending_entry', id)
    out[i] = 1
  end
end
return out
"""


def old_enqueue(client: redis.Redis, keys: Keys, sessions: list[Session], now: float) -> None:
    skeys, args = [], [repr(now)]
    for s in sessions:
        skeys += [keys.session(s.session_id), keys.pending(s.workload)]
        args += [s.session_id, s.workload, s.model_dump_json()]
    assert client.eval(OLD_ENQUEUE, len(skeys), *skeys, *args) == [1] * len(sessions)


def prompt_session(i: int, tokens: int = 150, seed: int = 0) -> Session:
    rng = random.Random(seed + i // 8)  # GRPO groups of 8 share a prompt
    return Session(session_id=f"m{i}", workload="rlvr", group_id=f"g{i // 8}", group_size=8,
                   prompt_token_ids=[rng.randrange(128_256) for _ in range(tokens)],
                   max_tokens=4096)


# -- the stored body ----------------------------------------------------------------------------
SESSIONS = [
    make_session(1),
    prompt_session(3),
    Session(session_id="t", workload="agentic", prompt_text="héllo \"wörld\"", max_tokens=9,
            max_turns=3, policy_version=4, on_stale="refresh", max_attempts=5,
            metadata={"tool": "calc", "x": 1.5, "y": True, "z": "a\"b", "n": -3},
            sampling=SamplingParams(temperature=0.7, stop=["\n"], stop_token_ids=[2], seed=7)),
    Session(session_id="big", workload="rlvr", prompt_token_ids=[0, 2**32 - 1, 5], max_tokens=1),
    Session(session_id="huge", workload="rlvr", prompt_token_ids=[2**40, 1], max_tokens=1),
    make_session(2).model_copy(update={"resume_from": PartialRollout(
        turn_records=[TurnRecord(turn=0, input_token_ids=[1, 2], output_token_ids=[3, 4],
                                 output_logprobs=[-0.5, -0.25], finish_reason="stop")],
        history_token_ids=[1, 2, 3, 4, 9], turn=1, next_input_token_ids=[9])}),
]


@pytest.mark.parametrize("session", SESSIONS, ids=lambda s: s.session_id)
def test_the_stored_body_gives_the_same_session_back(session):
    stored = dump_body(session)
    assert load_body(stored) == session
    assert load_body(stored.encode()) == session
    assert load_body(session.model_dump_json()) == session  # an earlier version's form


@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=1, max_size=300))
def test_packed_ids_round_trip(ids):
    assert unpack_ids(pack_ids(ids)) == ids


def test_the_stored_body_is_compact():
    s = prompt_session(0)
    stored = dump_body(s)
    assert len(stored) <= 560 < len(s.model_dump_json()) // 2  # 537 B against 1,309 B
    assert "sampling" not in stored and "max_attempts" not in stored  # defaults are left out


@pytest.mark.parametrize("bad", ["{not json", '{"session_id":"x","prompt_token_ids":"!!"}',
                                 '{"session_id":"x","workload":"rlvr","max_tokens":1,'
                                 '"prompt_token_ids":"AQ=="}'])
def test_a_bad_stored_body_raises_value_error(bad):
    with pytest.raises(ValueError):
        load_body(bad)


# -- where it is stored -------------------------------------------------------------------------
def test_a_pending_entry_holds_no_body_and_the_body_is_stored_once(redis_url, namespace,
                                                                   redis_client):
    k = Keys(namespace)
    s = prompt_session(0)
    with RolloutClient(redis_url, namespace) as client:
        assert client.enqueue([s]) == ["m0"]
        assert client.enqueue([s]) == []  # a repeat is a no-op
    [(_, fields)] = redis_client.xrange(k.pending("rlvr"))
    assert fields == {b"sid": b"m0"}
    state = redis_client.hgetall(k.session("m0"))
    assert b"session" not in state and state[b"state"] == b"pending"
    assert redis_client.object("encoding", k.session("m0")) == b"listpack"  # small fields only
    assert redis_client.get(k.body("m0")) == dump_body(s).encode()
    assert load_body(redis_client.get(k.body("m0"))) == s


def test_redis_memory_per_pending_session_is_at_most_1_kb():
    """used_memory growth of a private Redis (nobody else's keys) per pending 150-token session,
    enqueued as a trainer does; measured 898 B (3,357 B when the body was stored twice)."""
    n = 4_000
    with start_private_redis() as handle:
        r = redis.Redis.from_url(handle.url)
        with RolloutClient(handle.url, "mem") as client:
            client.enqueue([prompt_session(i) for i in range(n, n + 64)])  # scripts, streams
            before = int(r.info("memory")["used_memory"])
            for start in range(0, n, 1_000):
                client.enqueue([prompt_session(i) for i in range(start, start + 1_000)])
            per = (int(r.info("memory")["used_memory"]) - before) / n
        r.close()
    assert per <= 1024, f"{per:.0f} B per pending session"


# -- entries an earlier version wrote -----------------------------------------------------------
def test_sessions_enqueued_by_an_earlier_version_are_served_with_their_bodies(
        redis_url, namespace, redis_client):
    """Old pending entries (body inline) and an old requeue entry are admitted beside new ones;
    the worker gets every body; a hand-back moves an old body to the body key, once."""
    k = Keys(namespace)
    old = [prompt_session(i, tokens=20, seed=1) for i in range(3)]
    new = [prompt_session(i, tokens=20, seed=2).model_copy(update={"session_id": f"n{i}"})
           for i in range(3)]
    requeued = make_session(9, prompt_len=12)
    with RolloutClient(redis_url, namespace) as client:
        client.enqueue([make_session(99)])  # the namespace and its workloads exist
        client.cancel("s99")
        old_enqueue(redis_client, k, old, 1_000.0)
        # a session an earlier broker had requeued: the body in the entry and the hash
        redis_client.hset(k.session("s9"), mapping={
            "state": "pending", "workload": "rlvr", "session": requeued.model_dump_json(),
            "enqueued_at": "999.0"})
        eid = redis_client.xadd(k.requeue("rlvr"), {"sid": "s9", "session":
                                requeued.model_dump_json(), "enqueued_at": "999.0"})
        redis_client.hset(k.session("s9"), "pending_entry", eid)
        client.enqueue(new)
        link = WorkerLink(redis_url, namespace, "b0")
        link.register(1_000_000, 32_768)
        link.heartbeat(METRICS)
        broker = BrokerThread(redis_url, namespace).start()
        want = {s.session_id: s for s in old + new + [requeued]}
        got: dict[str, Session] = {}
        try:
            assert wait_until(lambda: got.update({a.session.session_id: a.session
                                                  for a in link.read_admitted(block_ms=100)})
                              or len(got) >= len(want), timeout=30)
            assert got == want
            assert link.hand_back([old[0]], "test") == (1, 0)
            # moved to the body key; the hash keeps no copy, the requeue entry none either
            assert not redis_client.hexists(k.session("m0"), "session")
            assert load_body(redis_client.get(k.body("m0"))) == old[0]
            again: list = []
            assert wait_until(lambda: again.extend(link.read_admitted(block_ms=100)) or again,
                              timeout=30)
            assert [a.session for a in again] == [old[0]]
        finally:
            broker.stop()
            link.close()
        assert redis_client.xlen(k.dead_letter) == 0
