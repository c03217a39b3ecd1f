"""Each Lua script's contract, called directly on a real Redis."""

from __future__ import annotations

import pytest
import redis

from broker.body import load_body
from broker.heartbeat import EngineMetrics
from broker.keys import BROKER_GROUP, Keys
from broker.ledger import Ledger
from broker.queue import SessionQueue
from broker.scripts import Scripts
from broker.session import SessionResult, SessionState
from broker.streams import as_text
from broker.worker_link import WorkerLink
from tests.broker.helpers import make_session, wait_until

METRICS = EngineMetrics(kv_usage=0.1, running=0, waiting=0, preemptions_total=0,
                        prefix_queries_total=0, prefix_hits_total=0)
TOKEN = "tok"


class World:
    def __init__(self, url: str, ns: str, client: redis.Redis) -> None:
        self.url, self.ns, self.r = url, ns, client
        self.k = Keys(ns)
        self.s = Scripts(client)
        self.q = SessionQueue(client, self.k, self.s)
        self.ledger = Ledger(client, self.k)
        client.set(self.k.lease, TOKEN)
        self.q.ensure_broker_groups(["rlvr", "rlhf"])

    def backend(self, b: str, capacity: int = 100) -> WorkerLink:
        link = WorkerLink(self.url, self.ns, b)
        link.register(capacity, 4096)
        link.heartbeat(METRICS)
        return link

    def read_pending(self, workload: str = "rlvr") -> dict[str, str]:
        reply = self.r.xreadgroup(BROKER_GROUP, "b1", {self.k.pending(workload): ">"}, count=1000)
        return {e[1][b"sid"].decode(): e[0].decode() for e in (reply[0][1] if reply else [])}

    def admit(self, sid: str, b: str, charge: int, entry: str, token: str = TOKEN,
              workload: str = "rlvr", enforce: str = "1") -> str:
        k = self.k
        return as_text(self.s.admit(
            keys=[k.lease, k.session(sid), k.ledger(b), k.ledger_sessions(b), k.heartbeat(b),
                  k.admitted(b), k.pending(workload)],
            args=[token, sid, b, charge, entry, "1.0", enforce]))

    def admitted(self, b: str, *ids: int, charge: int = 10) -> WorkerLink:
        """Sessions s<id> enqueued and admitted to backend `b` (registered here); its link."""
        link = self.backend(b)
        self.q.enqueue([make_session(i) for i in ids])
        entries = self.read_pending()
        for i in ids:
            assert self.admit(f"s{i}", b, charge, entries[f"s{i}"]) == "ok"
        return link

    def reserved(self, b: str) -> int:
        return self.ledger.read(b).reserved_tokens

    def state(self, sid: str) -> str:
        return self.q.state(sid)


@pytest.fixture
def world(redis_url, namespace, redis_client):
    return World(redis_url, namespace, redis_client)


def result(sid: str, workload: str = "rlvr") -> SessionResult:
    return SessionResult(session_id=sid, workload=workload, status=SessionState.done)


def test_enqueue_is_idempotent_by_session_id(world):
    first = world.q.enqueue([make_session(1), make_session(2)])
    again = world.q.enqueue([make_session(2), make_session(3), make_session(3)])
    assert first == ["s1", "s2"]
    assert again == ["s3"]
    assert world.r.xlen(world.k.pending("rlvr")) == 3
    assert world.state("s2") == "pending"


def test_admit_reserves_moves_and_acks_all_together(world):
    link = world.backend("b0", capacity=100)
    world.q.enqueue([make_session(1)])
    entry = world.read_pending()["s1"]
    assert world.admit("s1", "b0", 40, entry) == "ok"
    led = world.ledger.read("b0")
    assert (led.reserved_tokens, led.reserved_by_workload, led.sessions) == (40, {"rlvr": 40}, {"s1": 40})
    assert world.state("s1") == "admitted"
    assert world.r.xlen(world.k.pending("rlvr")) == 0  # acked and deleted
    assert world.r.xpending(world.k.pending("rlvr"), BROKER_GROUP)["pending"] == 0
    [adm] = link.read_admitted(block_ms=None)
    assert (adm.session.session_id, adm.reserved_tokens) == ("s1", 40)
    # When it was admitted, from the admitted entry's id (Redis's clock, in ms): what the
    # worker sends the engine as the session's priority.
    server_ms = int(world.r.time()[0]) * 1000
    assert abs(adm.admitted_ms - server_ms) < 5_000


def test_admit_refusals_change_nothing(world):
    world.backend("b0", capacity=100)
    world.q.enqueue([make_session(i) for i in range(3)])
    entries = world.read_pending()
    assert world.admit("s0", "b0", 90, entries["s0"]) == "ok"
    # over alpha*C: 90 + 20 > 100
    assert world.admit("s1", "b0", 20, entries["s1"]) == "no_capacity"
    # a broker without the lease changes nothing
    assert world.admit("s1", "b0", 5, entries["s1"], token="other") == "lease"
    # unknown backend, then a registered one without a fresh heartbeat
    assert world.admit("s1", "nope", 5, entries["s1"]) == "no_backend"
    WorkerLink(world.url, world.ns, "b1").register(100, 4096)
    assert world.admit("s1", "b1", 5, entries["s1"]) == "unhealthy"
    assert world.admit("s1", "b0", -1, entries["s1"]) == "bad_charge"
    assert world.reserved("b0") == 90 and world.state("s1") == "pending"
    assert world.r.xlen(world.k.pending("rlvr")) == 2
    # already admitted: refused and the stale entry is acked
    assert world.admit("s0", "b0", 1, entries["s0"]) == "not_pending"
    assert world.reserved("b0") == 90


def test_admit_respects_alpha(world):
    world.backend("b0", capacity=100)
    world.ledger.set_alpha("b0", 1.5)
    world.q.enqueue([make_session(i) for i in range(2)])
    e = world.read_pending()
    assert world.admit("s0", "b0", 150, e["s0"]) == "ok"
    assert world.admit("s1", "b0", 1, e["s1"]) == "no_capacity"


def test_router_dispatch_is_charged_but_not_limited(world):
    world.backend("b0", capacity=100)
    world.q.enqueue([make_session(i) for i in range(2)])
    e = world.read_pending()
    assert world.admit("s0", "b0", 90, e["s0"], enforce="0") == "ok"
    assert world.admit("s1", "b0", 90, e["s1"], enforce="0") == "ok"
    assert world.reserved("b0") == 180


def test_finish_publishes_once_and_releases(world):
    link = world.backend("b0")
    world.q.enqueue([make_session(1)])
    assert world.admit("s1", "b0", 30, world.read_pending()["s1"]) == "ok"
    link.read_admitted(block_ms=None)
    assert link.mark_running("s1")
    assert link.finish(result("s1")) == "ok"
    assert link.finish(result("s1")) == "duplicate"
    assert world.r.xlen(world.k.results) == 1
    assert world.reserved("b0") == 0 and world.ledger.read("b0").reserved_by_workload == {"rlvr": 0}
    assert world.state("s1") == "done"
    assert world.r.xlen(world.k.admitted("b0")) == 0
    assert world.ledger.kv_seconds()["rlvr"][1] == 1


def test_finish_from_another_backend_is_stale(world):
    world.backend("b0")
    other = world.backend("b1")
    world.q.enqueue([make_session(1)])
    world.admit("s1", "b0", 30, world.read_pending()["s1"])
    assert other.finish(result("s1")) == "stale"
    assert not other.mark_running("s1")
    assert world.r.xlen(world.k.results) == 0 and world.reserved("b0") == 30


def test_cancel_pending_and_admitted(world):
    world.backend("b0")
    from broker.client import RolloutClient
    client = RolloutClient(world.url, world.ns)
    world.q.enqueue([make_session(1), make_session(2)])
    e = world.read_pending()
    world.admit("s2", "b0", 30, e["s2"])
    assert client.cancel("s1") == "cancelled"
    assert client.cancel("s2") == "cancelled"
    assert client.cancel("s2") == "cancelled"  # already: reports the terminal state
    assert client.cancel("zzz") == "unknown"
    assert world.reserved("b0") == 0
    assert world.admit("s1", "b0", 1, e["s1"]) == "not_pending"
    assert world.r.xlen(world.k.results) == 0
    client.close()


def requeue_keys(k: Keys, b: str, sids_workloads: list[tuple[str, str]]) -> list[str]:
    keys = [k.lease, k.heartbeat(b), k.ledger(b), k.ledger_sessions(b), k.admitted(b), k.events,
            k.results, k.settings, k.kv_seconds]
    for sid, w in sids_workloads:
        keys += [k.session(sid), k.requeue(w), k.body(sid)]
    return keys


def test_requeue_of_a_dead_backend_goes_to_the_front_and_releases(world, redis_client):
    link = world.backend("b0")
    world.q.enqueue([make_session(1), make_session(2), make_session(3)])
    e = world.read_pending()
    world.admit("s1", "b0", 10, e["s1"])
    world.admit("s2", "b0", 20, e["s2"])
    link.mark_running("s2")
    k = world.k
    keys = requeue_keys(k, "b0", [("s1", "rlvr"), ("s2", "rlvr")])
    args = [TOKEN, "b0", "2.0", "heartbeat expired", "dead", "s1", "s2"]
    assert as_text(world.s.requeue(keys=keys, args=args)) == "alive"
    redis_client.delete(k.heartbeat("b0"))  # the TTL ran out
    assert as_text(world.s.requeue(keys=keys, args=["x"] + args[1:])) == "lease"
    assert world.s.requeue(keys=keys, args=args) == [2, 0]
    assert world.reserved("b0") == 0 and world.ledger.read("b0").sessions == {}
    assert world.state("s1") == world.state("s2") == "pending"
    requeued = redis_client.xrange(k.requeue("rlvr"))
    assert [f[b"sid"] for _, f in requeued] == [b"s1", b"s2"]
    assert requeued[0][1][b"enqueued_at"] == redis_client.hget(k.session("s1"), "enqueued_at")
    assert not redis_client.exists(k.admitted("b0"))
    # only the session that had started counts an attempt
    assert redis_client.hmget(k.session("s1"), "attempts", "last_error") == [b"0", b"heartbeat expired"]
    assert redis_client.hget(k.session("s2"), "attempts") == b"1"


def test_a_requeue_goes_on_from_the_last_checkpoint_of_the_backend_running_it(world, redis_client):
    from broker.session import PartialRollout, Session, TurnRecord

    link, other = world.admitted("b0", 1, 2), world.backend("b1")
    k = world.k

    def body(sid: str, turn: int) -> Session:
        rec = TurnRecord(turn=0, input_token_ids=[1, 2], output_token_ids=[3] * turn)
        return make_session(int(sid[1:])).model_copy(update={"resume_from": PartialRollout(
            turn_records=[rec], history_token_ids=[1, 2] + [3] * turn + [4], turn=turn,
            next_input_token_ids=[4])})

    assert not link.checkpoint(body("s1", 1))  # admitted, not running yet: nothing to keep
    link.mark_running_many(["s1", "s2"])
    assert not other.checkpoint(body("s1", 1))  # only the backend running it writes
    assert link.checkpoint(body("s1", 1)) and link.checkpoint(body("s1", 2))
    assert link.checkpoint(body("s2", 1))
    redis_client.delete(k.heartbeat("b0"))  # b0 died
    assert world.s.requeue(keys=requeue_keys(k, "b0", [("s1", "rlvr"), ("s2", "rlvr")]),
                           args=[TOKEN, "b0", "2.0", "heartbeat expired", "dead", "s1", "s2"]
                           + ["", body("s2", 7).model_dump_json()]) == [2, 0]
    requeued = {f[b"sid"].decode(): load_body(redis_client.get(k.body(f[b"sid"].decode())))
                for _, f in redis_client.xrange(k.requeue("rlvr"))}
    assert requeued["s1"] == body("s1", 2)  # the latest checkpoint
    assert requeued["s2"] == body("s2", 7)  # a body given (a drain's) wins over a checkpoint
    assert not redis_client.hexists(k.session("s1"), "session")  # one copy: the body key
    assert not redis_client.hexists(k.session("s1"), "checkpoint")
    assert not redis_client.hexists(k.session("s2"), "checkpoint")


def test_finish_counts_results_tokens_and_failures_per_workload(world, redis_client):
    link = world.admitted("b0", 1, 2)
    done = SessionResult(session_id="s1", workload="rlvr", status=SessionState.done,
                         output_tokens=7)
    failed = SessionResult(session_id="s2", workload="rlvr", status=SessionState.failed,
                           output_tokens=2, error="engine: boom")
    assert link.finish(done) == "ok" and link.finish(failed) == "ok"
    assert link.finish(done) == "duplicate"  # counted once
    counts = {k.decode(): v.decode() for k, v in redis_client.hgetall(world.k.kv_seconds).items()}
    assert (counts["n:rlvr"], counts["tok:rlvr"], counts["failed:rlvr"]) == ("2", "9", "1")
    assert set(world.ledger.kv_seconds()) == {"rlvr"}  # the counters are not workloads


@pytest.mark.parametrize("latency_s", [0.0, 0.005, 0.02, 0.5, 0.51, 1.0, 1.2, 2.0, 3.0, 90.0, 4096.0, 5000.0])
def test_finish_counts_latency_in_the_bucket_python_reads(world, redis_client, latency_s):
    """finish.lua's bucket of (finished − enqueued) is broker.latency.bucket_of's."""
    from broker import latency

    link = world.admitted("b0", 1)
    enqueued = float(redis_client.hget(world.k.session("s1"), "enqueued_at"))
    assert link.finish(result("s1"), now=enqueued + latency_s) == "ok"
    fields = {k.decode(): int(v) for k, v in redis_client.hgetall(world.k.kv_seconds).items()
              if k.startswith(b"lat:")}
    assert fields == {f"lat:rlvr:{latency.bucket_of(latency_s)}": 1}
    i = latency.bucket_of(latency_s)
    assert (latency_s <= latency.upper_bound_s(i)
            and (i == latency.MIN_BUCKET or latency_s > latency.upper_bound_s(i - 1)))


def test_finish_drops_the_checkpoint(world, redis_client):
    from broker.session import PartialRollout

    link = world.admitted("b0", 1)
    link.mark_running("s1")
    assert link.checkpoint(make_session(1).model_copy(update={"resume_from": PartialRollout(
        turn_records=[], history_token_ids=[1], turn=1)}))
    assert link.finish(result("s1")) == "ok"
    assert not redis_client.hexists(world.k.session("s1"), "checkpoint")
    assert not link.checkpoint(make_session(1))  # done: nothing more to keep


def test_a_late_finish_is_taken_until_another_backend_has_the_session(world, redis_client):
    link = world.backend("b0")
    other = world.backend("b1")
    world.q.enqueue([make_session(1), make_session(2)])
    e = world.read_pending()
    world.admit("s1", "b0", 10, e["s1"])
    world.admit("s2", "b0", 10, e["s2"])
    link.mark_running_many(["s1", "s2"])
    k = world.k
    redis_client.delete(k.heartbeat("b0"))
    world.s.requeue(keys=requeue_keys(k, "b0", [("s1", "rlvr"), ("s2", "rlvr")]),
                    args=[TOKEN, "b0", "2.0", "heartbeat expired", "dead", "s1", "s2"])
    # s1 is re-admitted to b1 before b0's finish arrives; s2 is still waiting in the queue
    reply = redis_client.xreadgroup(BROKER_GROUP, "b", {k.requeue("rlvr"): ">"})
    entries = {f[b"sid"].decode(): eid.decode() for eid, f in reply[0][1]}
    assert as_text(world.s.admit(
        keys=[k.lease, k.session("s1"), k.ledger("b1"), k.ledger_sessions("b1"),
              k.heartbeat("b1"), k.admitted("b1"), k.requeue("rlvr")],
        args=[TOKEN, "s1", "b1", 10, entries["s1"], "3.0", "1"])) == "ok"
    assert link.finish(result("s1")) == "stale"  # b1 has it now: b0's result would be a second
    assert link.finish(result("s2")) == "ok"  # nobody else has it: first finish wins
    assert world.state("s2") == "done"
    # s2's requeue entry went with its finish: the broker will never admit it again
    assert redis_client.xlen(k.requeue("rlvr")) == 0
    assert redis_client.xpending(k.requeue("rlvr"), BROKER_GROUP)["pending"] == 0
    assert [f[b"sid"] for _, f in redis_client.xrange(k.results)] == [b"s2"]
    assert redis_client.hget(k.stats, "stale_finishes") == b"1"
    assert other.finish(result("s1")) == "ok"


def test_out_of_attempts_ends_failed_with_one_result(world, redis_client):
    link = world.backend("b0")
    world.q.enqueue([make_session(1).model_copy(update={"max_attempts": 2})])
    k = world.k
    for attempt in (1, 2):
        entry = (world.read_pending() if attempt == 1 else {
            f[b"sid"].decode(): eid.decode()
            for eid, f in redis_client.xreadgroup(BROKER_GROUP, "b", {k.requeue("rlvr"): ">"})[0][1]})
        source = k.pending("rlvr") if attempt == 1 else k.requeue("rlvr")
        assert as_text(world.s.admit(
            keys=[k.lease, k.session("s1"), k.ledger("b0"), k.ledger_sessions("b0"),
                  k.heartbeat("b0"), k.admitted("b0"), source],
            args=[TOKEN, "s1", "b0", 10, entry["s1"], "1.0", "1"])) == "ok"
        assert link.mark_running("s1")
        requeued, failed = link.hand_back([make_session(1)], f"engine: refused ({attempt})")
        assert (requeued, failed) == ((1, 0) if attempt == 1 else (0, 1))
    assert world.state("s1") == "failed" and world.reserved("b0") == 0
    [(_, fields)] = redis_client.xrange(k.results)
    r = SessionResult.model_validate_json(fields[b"result"])
    assert r.status == SessionState.failed and r.session_id == "s1" and r.workload == "rlvr"
    assert "gave up after 2 attempts" in r.error and "engine: refused (2)" in r.error
    assert link.finish(result("s1")) == "duplicate"
    assert link.hand_back([make_session(1)], "again") == (0, 0)


def test_hand_back_leaves_the_backend_at_once(world, redis_client):
    link = world.admitted("b0", 1, 2)
    assert len(link.read_admitted(count=10, block_ms=None)) == 2
    assert link.mark_running("s1")
    assert link.hand_back([make_session(1)], "engine: timed out") == (1, 0)
    assert world.state("s1") == "pending" and world.state("s2") == "admitted"
    assert world.ledger.read("b0").sessions == {"s2": 10}
    # its admitted entry is gone: a restarted worker's backlog does not hand it out again
    again = WorkerLink(world.url, world.ns, "b0")
    assert [a.session.session_id for a in again.read_admitted(count=10, block_ms=None)] == ["s2"]
    assert redis_client.exists(world.k.admitted("b0"))  # a live backend keeps its stream


def test_recharge_keeps_the_limit(world):
    world.backend("b0", capacity=100)
    world.q.enqueue([make_session(1), make_session(2)])
    e = world.read_pending()
    world.admit("s1", "b0", 40, e["s1"])
    world.admit("s2", "b0", 40, e["s2"])
    k = world.k

    def recharge(sid, new):
        return as_text(world.s.recharge(keys=[k.lease, k.session(sid), k.ledger("b0"),
                                              k.ledger_sessions("b0")], args=[TOKEN, sid, "b0", new, "1"]))
    assert recharge("s1", 61) == "no_capacity"
    assert recharge("s1", 60) == "ok"
    assert recharge("s2", 10) == "ok"
    assert world.reserved("b0") == 70
    assert world.ledger.read("b0").reserved_by_workload == {"rlvr": 70}


def test_lease_is_compare_and_set(world, redis_client):
    from broker.lease import Lease
    a = Lease(redis_client, Keys(world.ns + "x"), world.s, period_s=5)
    b = Lease(redis_client, Keys(world.ns + "x"), world.s, period_s=5)
    try:
        assert a.try_acquire() and not b.try_acquire()
        assert not b.renew() and a.renew()
        b.held = True
        b.release()  # not the holder: must not delete a's lease
        assert redis_client.get(Keys(world.ns + "x").lease) == a.token.encode()
        a.release()
        assert b.try_acquire()
    finally:
        redis_client.delete(Keys(world.ns + "x").lease)


def test_heartbeat_needs_registration_and_expires(world, redis_client):
    link = WorkerLink(world.url, world.ns, "b9", heartbeat_ttl_s=0.5)
    with pytest.raises(RuntimeError, match="not registered"):
        link.heartbeat(METRICS)
    link.register(100, 4096)
    link.heartbeat(METRICS)
    ttl = redis_client.pttl(world.k.heartbeat("b9"))
    assert 0 < ttl <= 500


def test_restarted_worker_gets_its_unfinished_backlog_first(world):
    link = world.backend("b0")
    world.q.enqueue([make_session(i) for i in range(3)])
    e = world.read_pending()
    for i in range(3):
        world.admit(f"s{i}", "b0", 5, e[f"s{i}"])
    assert len(link.read_admitted(count=10, block_ms=None)) == 3
    assert link.finish(result("s0")) == "ok"
    link.close()  # crash with s1, s2 read but unfinished
    again = WorkerLink(world.url, world.ns, "b0")
    backlog = again.read_admitted(count=1, block_ms=None) + again.read_admitted(count=1, block_ms=None)
    assert [a.session.session_id for a in backlog] == ["s1", "s2"]
    assert again.read_admitted(count=10, block_ms=50) == []


def test_cancel_while_running_means_the_worker_cannot_publish(world):
    from broker.client import RolloutClient
    link = world.backend("b0")
    world.q.enqueue([make_session(1)])
    world.admit("s1", "b0", 5, world.read_pending()["s1"])
    assert link.mark_running("s1")
    client = RolloutClient(world.url, world.ns)
    assert client.cancel("s1") == "cancelled"
    assert link.finish(result("s1")) == "duplicate"
    assert world.r.xlen(world.k.results) == 0 and world.reserved("b0") == 0
    client.close()


def test_every_change_to_a_ledgers_sessions_moves_its_version(world, redis_client):
    """broker/snapshot.py caches a ledger's sessions by its version: each script that changes
    the sessions hash must move it, and a cached read must equal a full one."""
    from broker.client import RolloutClient
    from broker.snapshot import ViewCache, read_fleet
    k = world.k
    cache = ViewCache()
    seen: list[tuple] = []

    def check(what: str) -> None:
        full = read_fleet(redis_client, k, ["b0", "b1"])
        cached = read_fleet(redis_client, k, ["b0", "b1"], cache=cache)
        assert cached.ledgers == full.ledgers, what
        now = {b: (led.version, dict(led.sessions)) for b, led in full.ledgers.items()}
        if seen:
            for b, (version, sessions) in now.items():
                before = seen[-1][b]
                assert version is not None, what
                if sessions != before[1]:
                    assert version != before[0], f"{what}: {b}'s sessions changed, not its version"
        seen.append(now)

    world.backend("b0")
    world.backend("b1")
    check("registered")
    link0 = world.admitted("b0", 1, 2, 3, 4)  # (registers b0 again: its epoch stays)
    check("admit")
    link0.read_admitted(count=10, block_ms=None)
    assert link0.mark_running("s1") and link0.mark_running("s2")
    assert as_text(world.s.recharge(keys=[k.lease, k.session("s1"), k.ledger("b0"),
                                          k.ledger_sessions("b0")],
                                    args=[TOKEN, "s1", "b0", 25, "1"])) == "ok"
    check("recharge")
    assert link0.finish(result("s1")) == "ok"
    check("finish")
    client = RolloutClient(world.url, world.ns)
    assert client.cancel("s2") == "cancelled"
    client.close()
    check("cancel")
    assert link0.hand_back([make_session(3)], "engine: timed out") == (1, 0)
    check("hand back (requeue)")


def test_admitted_entries_a_lost_read_delivered_are_read_again(world):
    """A read whose reply is lost to a reset still moved the entries into this backend's
    pending list: the next read starts from that backlog (else they stay admitted for good on
    a backend that is alive, and no requeue rule fires)."""
    import redis

    link = world.backend("b0", capacity=100)
    world.q.enqueue([make_session(1)])
    assert world.admit("s1", "b0", 40, world.read_pending()["s1"]) == "ok"
    assert [a.session.session_id for a in link.read_admitted(block_ms=None)] == ["s1"]
    real = link._client.xreadgroup

    def lost_reply(*args, **kwargs):
        real(*args, **kwargs)  # Redis delivers ...
        raise redis.ConnectionError("Connection reset by peer")  # ... the reply never arrives
    link._client.xreadgroup = lost_reply
    world.q.enqueue([make_session(2)])
    assert world.admit("s2", "b0", 40, world.read_pending()["s2"]) == "ok"
    with pytest.raises(redis.ConnectionError):
        link.read_admitted(block_ms=None)
    link._client.xreadgroup = real
    assert "s2" in [a.session.session_id for a in link.read_admitted(block_ms=None)]


# -- retention: an ended session leaves its hash for a while and nothing else ------------------
def retained(world, sid: str) -> tuple[bool, int]:
    """(the body is still stored, the hash's time to live in ms: -1 none, -2 gone)."""
    return bool(world.r.exists(world.k.body(sid))), world.r.pttl(world.k.session(sid))


def test_every_way_a_session_ends_retires_it(world, redis_client):
    from broker.client import RolloutClient

    k, day = world.k, 3600 * 1000
    link = world.admitted("b0", 1, 2)
    world.q.enqueue([make_session(3).model_copy(update={"max_attempts": 1}),
                     make_session(4), make_session(5), make_session(6)])
    pending = world.read_pending()
    assert world.admit("s3", "b0", 10, pending["s3"]) == "ok"
    assert all(retained(world, f"s{i}") == (True, -1) for i in range(1, 7))

    assert link.finish(result("s1")) == "ok"
    client = RolloutClient(world.url, world.ns)
    assert client.cancel("s2") == "cancelled"  # admitted
    link.mark_running("s3")
    assert link.hand_back([make_session(3)], "engine: refused") == (0, 1)  # out of attempts
    why = "policy_version: too stale"
    failed = SessionResult(session_id="s4", workload="rlvr", status=SessionState.failed, error=why)
    assert as_text(world.s.expire(
        keys=[k.lease, k.session("s4"), k.pending("rlvr"), k.results, k.settings, k.body("s4"),
              k.kv_seconds],
        args=[TOKEN, "s4", pending["s4"], "9.0", failed.model_dump_json(), why])) == "ok"
    [(eid, fields)] = [e for e in redis_client.xrange(k.pending("rlvr")) if e[1][b"sid"] == b"s5"]
    world.q.dead_letter(k.pending("rlvr"), as_text(eid), fields, "unreadable")
    for sid, state in (("s1", "done"), ("s2", "cancelled"), ("s3", "failed"), ("s4", "failed"),
                       ("s5", "dead_lettered")):
        body, ttl = retained(world, sid)
        assert world.state(sid) == state and not body and 0 < ttl <= day, (sid, body, ttl)
    # each of the three results published counts once, the failed ones as failed
    counts = redis_client.hgetall(k.kv_seconds)
    assert (counts[b"n:rlvr"], counts[b"failed:rlvr"]) == (b"3", b"2")
    assert redis_client.xlen(k.results) == 3
    # a pending session's queue entry still reaches the broker, which reads its body: both stay
    # until the hash expires
    assert client.cancel("s6") == "cancelled"
    client.close()
    assert redis_client.pttl(k.body("s6")) > 0 and 0 < redis_client.pttl(k.session("s6")) <= day


def test_the_retention_window_is_the_namespaces_and_no_finish_outlives_it(world, redis_client):
    from broker.client import RolloutClient

    k = world.k
    client = RolloutClient(world.url, world.ns)
    for bad in (0, 0.5, -3, float("nan"), float("inf"), "60", True, None):
        with pytest.raises(ValueError, match="session_retention_s"):
            client.set_session_retention(bad)
    client.set_session_retention(1)
    link = world.admitted("b0", 1)
    assert link.finish(result("s1")) == "ok"
    assert 0 < redis_client.pttl(k.session("s1")) <= 1000
    assert wait_until(lambda: not redis_client.exists(k.session("s1")), timeout=10)
    # the ended session's state is gone: a late finish is refused, never published again
    assert link.finish(result("s1")) == "stale"
    assert redis_client.xlen(k.results) == 1
    # and the id is new again
    assert world.q.enqueue([make_session(1)]) == ["s1"]
    client.close()


def test_an_acknowledged_result_leaves_the_stream(world, redis_client):
    from broker.client import RolloutClient

    k = world.k
    link = world.admitted("b0", 1, 2)
    client = RolloutClient(world.url, world.ns)
    assert link.finish(result("s1")) == "ok" and link.finish(result("s2")) == "ok"
    got = client.results(1, timeout=5)
    assert [r.session_id for r in got] == ["s1"]
    assert redis_client.xlen(k.results) == 2  # handed back, not acknowledged yet
    client.ack()
    assert [f[b"sid"] for _, f in redis_client.xrange(k.results)] == [b"s2"]
    assert redis_client.hget(k.consumed, "rlvr") == b"1"
    client.close()  # acknowledges what it was handed (s2 was only buffered)
    assert redis_client.xlen(k.results) == 1


def test_a_finish_feeds_the_broker_a_completion_the_trainers_ack_cannot_take(world, redis_client):
    """The broker learns lengths from the capped completions stream: the result itself may be
    acknowledged, and so deleted, before the broker reads it."""
    from broker.client import RolloutClient
    from broker.completions import CompletionStats, completion_from_entry, completion_of
    from broker.snapshot import read_fleet

    k = world.k
    link = world.admitted("b0", 1)
    done = SessionResult(session_id="s1", workload="rlvr", status=SessionState.done,
                         output_tokens=7, prompt_tokens=8, turns=1)
    stats = CompletionStats(turn_output_tokens=[7], tool_wait_s=0.5, kv_token_seconds=12.5)
    assert link.finish(done, stats) == "ok"
    client = RolloutClient(world.url, world.ns)
    assert [r.session_id for r in client.results(1, timeout=5)] == ["s1"]
    client.close()  # acknowledged: the result has left the stream
    assert redis_client.xlen(k.results) == 0
    fleet = read_fleet(redis_client, k, ["b0"], completions_after="0-0")
    [(_, fields)] = fleet.completions
    got = completion_from_entry(fields)
    assert got == completion_of(done.model_copy(update={"backend_id": "b0",
                                                        "finished_at": got.finished_at}), stats)
    assert got.finished_at > 0
    assert (got.output_tokens, got.turn_output_tokens, got.kv_token_seconds) == (7, (7,), 12.5)
    assert completion_from_entry({b"completion": b"{not json"}) is None


def test_an_admitted_entry_whose_body_is_gone_is_dropped_not_a_crash(world):
    """A worker that reads an admitted entry whose session's body was deleted (it ended
    meanwhile) acknowledges and skips it; it does not stop on a KeyError."""
    link = world.backend("b0", capacity=100)
    world.q.enqueue([make_session(1), make_session(2)])
    pending = world.read_pending()
    assert world.admit("s1", "b0", 10, pending["s1"]) == "ok"
    assert world.admit("s2", "b0", 10, pending["s2"]) == "ok"
    world.r.delete(world.k.body("s1"))
    [adm] = link.read_admitted(block_ms=None)
    assert adm.session.session_id == "s2"
    assert world.r.xpending(world.k.admitted("b0"), "workers")["pending"] == 1  # s2's only
