"""Two jobs sharing one fleet end to end: namespaces A and B, each with its own broker
(MISA-T), queues and LoRA adapters, on four workers that serve both (simulated engines, real
Redis). Two engines serve model m-a and two m-b, every one with LoRA; A trains adapters a1 and
a2 on m-a and also samples m-b, B trains b1 on m-b and also samples m-a, so both jobs contend
on every engine. A is guaranteed 30% of each engine and B 70% (broker/shares.py).

Measured every 0.1 s: the KV each job's requests hold, read from the engines themselves, and
the part of each engine each job's heartbeats say it may plan against:
- A alone may plan against the whole fleet (it borrows B's idle share) and holds more than it
  does beside B;
- once both are queued, each may plan against its guaranteed share of every engine and holds
  about that share of the KV in use, B's growing back as A's borrowed sessions end;
- every session runs on an engine serving its model and adapter, once."""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import pytest
import redis

from broker.client import RolloutClient
from broker.policies import make_policy
from broker.session import Session, SessionState
from broker.shares import is_waiting
from sim.server.testing import RunningEngine, running_engine
from tests.broker.helpers import BrokerThread, wait_until
from tests.workers.helpers import WorkerThread, prompt

pytestmark = pytest.mark.timeout(240)

SHARES = {"a": 0.3, "b": 0.7}
KV = 12_000  # tokens per engine: 8 of these sessions at their longest fill one
ENGINES = {"e1": "m-a", "e2": "m-a", "e3": "m-b", "e4": "m-b"}
TOLERANCE = 0.1  # sampling, and the α loop settling under each part


def jobs_sessions(job: str, n: int) -> list[Session]:
    """`n` sessions of one job, alternating over its model/adapter pairs."""
    kinds = {"a": [("m-a", "a1"), ("m-a", "a2"), ("m-b", None)],
             "b": [("m-b", "b1"), ("m-a", None)]}[job]
    out = []
    for i in range(n):
        model, adapter = kinds[i % len(kinds)]
        out.append(Session(session_id=f"{job}-{i}", workload="rlvr", model=model,
                           adapter=adapter, prompt_token_ids=prompt(i, 512), max_tokens=1024,
                           sampling={"ignore_eos": True, "seed": i}))
    return out


# The engine's id of a worker's request holds its session's: 'generate-token-a-12-t0-0-0'.
_JOB_OF_REQUEST = re.compile(r"(?:^|-)([ab])-\d+-t\d+")


class KvSampler:
    """Every 0.1 s, per job: the KV its requests hold in the four engines (the tokens each
    engine has computed for them, read from the engines themselves), the part of the
    engines its heartbeats say it may plan against, and on how many engines its broker says
    it has work waiting (where it does not, the other job may use that engine's whole KV)."""

    def __init__(self, redis_client, namespaces: dict[str, str],
                 engines: dict[str, RunningEngine]) -> None:
        self.redis = redis_client
        self.namespaces = namespaces  # job -> namespace
        self.engines = engines
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            held = {job: 0 for job in self.namespaces}
            for e in self.engines.values():
                # (the engine's thread may add a request meanwhile: read it next time)
                try:
                    computed = e.core.computed_tokens()
                except RuntimeError:
                    continue
                for request_id, tokens in computed.items():
                    held[_JOB_OF_REQUEST.search(request_id)[1]] += tokens
            pipe = self.redis.pipeline(transaction=False)  # one round trip per sample
            for ns in self.namespaces.values():
                for b in ENGINES:
                    pipe.get(f"rb:{{{ns}}}:hb:{b}")
                    pipe.hget(f"rb:{{{ns}}}:ledger:{b}", "waiting_at")
            replies, now = iter(pipe.execute()), time.time()
            for job in self.namespaces:
                per_engine = [(next(replies), next(replies)) for _ in ENGINES]
                held[f"{job}_part"] = sum(json.loads(beat)["shared"]["capacity_tokens"]
                                          for beat, _ in per_engine if beat)
                held[f"{job}_waiting"] = sum(is_waiting(float(at) if at else None, now)
                                             for _, at in per_engine)
            self.samples.append((time.monotonic(), held))

    def start(self) -> KvSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def mean(self, since: float, until: float) -> dict[str, float]:
        window = [h for t, h in self.samples if since <= t < until]
        assert window, "no samples in the window"
        return {key: sum(h[key] for h in window) / len(window) for key in window[0]}


@dataclass
class TwoJobFleet:
    namespaces: dict[str, str]  # job -> namespace
    clients: dict[str, RolloutClient]
    sampler: KvSampler
    redis: redis.Redis

    def wait_for_waiting(self, job: str) -> None:
        """Until `job`'s broker has read its queue and says it waits on some engine."""
        assert wait_until(lambda: any(self.redis.hget(
            f"rb:{{{self.namespaces[job]}}}:ledger:{b}", "waiting_at") for b in ENGINES),
            timeout=30)

    def queued(self) -> dict[str, int]:
        return {job: sum(c.status()["pending"].values()) for job, c in self.clients.items()}

    def alone_then_both(self, batches: dict[str, list[Session]], first: str, alone_s: float,
                        both_s: float, skip_s: float) -> tuple[dict, dict, dict[str, int]]:
        """Enqueues `first`'s batch and samples it alone for `alone_s` (its first 2 s left
        out); then enqueues the other's, and once that one's broker says it waits, samples
        both for `both_s`, the first `skip_s` left out (the other's share comes back as the
        borrowed sessions end). Returns both means and what each job still had queued."""
        second = next(job for job in batches if job != first)
        self.clients[first].enqueue(batches[first])
        t0 = time.monotonic()
        time.sleep(alone_s)
        alone = self.sampler.mean(t0 + 2.0, time.monotonic())
        self.clients[second].enqueue(batches[second])
        self.wait_for_waiting(second)
        t1 = time.monotonic()
        time.sleep(both_s)
        return alone, self.sampler.mean(t1 + skip_s, time.monotonic()), self.queued()


@contextmanager
def two_job_fleet(redis_url: str, prefix: str = "share",
                  time_scale: float = 10.0) -> Iterator[TwoJobFleet]:
    """The fleet above, running: four engines, four workers serving both jobs, a MISA-T broker
    per job, the jobs' adapters registered, the sampler started (benchmarks/shared_fleet.py
    runs it too)."""
    tag = uuid.uuid4().hex[:8]
    namespaces = {job: f"{prefix}-{job}-{tag}" for job in SHARES}
    tenants = {namespaces[job]: share for job, share in SHARES.items()}
    with ExitStack() as stack:
        engines = {b: stack.enter_context(running_engine(time_scale=time_scale, kv_tokens=KV,
                                                         model_name=model, max_loras=2))
                   for b, model in ENGINES.items()}
        workers = [WorkerThread(redis_url, namespaces["a"], b, e.url, time_scale=time_scale,
                                tenants=tenants).start() for b, e in engines.items()]
        # (a lease of 10 s: two brokers, four engines and eight workers share this process)
        brokers = [BrokerThread(redis_url, ns, make_policy("misa_t"), lease_s=10.0).start()
                   for ns in namespaces.values()]
        clients = {job: RolloutClient(redis_url, ns) for job, ns in namespaces.items()}
        client = redis.Redis.from_url(redis_url)
        sampler = KvSampler(client, namespaces, engines).start()
        try:
            for c in clients.values():
                assert wait_until(lambda c=c: all(
                    c.status()["backends"].get(b, {}).get("healthy") for b in ENGINES),
                    timeout=30)
            clients["a"].register_adapter("a1", "/adapters/a1")
            clients["a"].register_adapter("a2", "/adapters/a2")
            clients["b"].register_adapter("b1", "/adapters/b1")
            yield TwoJobFleet(namespaces, clients, sampler, client)
        finally:
            sampler.stop()
            for br in brokers:
                br.stop()
            for w in workers:
                w.stop()
            for c in clients.values():
                c.close()
            for ns in namespaces.values():
                for key in client.scan_iter(match=f"rb:{{{ns}}}:*", count=1000):
                    client.delete(key)
            client.close()


def test_two_jobs_share_four_workers_by_their_guaranteed_shares(redis_url):
    with two_job_fleet(redis_url) as fleet:
        clients = fleet.clients
        # A job may not name the other's adapter: each registry is its own.
        with pytest.raises(ValueError, match=r"adapter: 'a1' is not registered"):
            clients["b"].enqueue([Session(session_id="x", workload="rlvr", model="m-a",
                                          adapter="a1", prompt_token_ids=[1, 2, 3],
                                          max_tokens=8)])

        # (enough that A still has sessions queued when the contended window ends)
        a_batch, b_batch = jobs_sessions("a", 960), jobs_sessions("b", 560)
        # Contention starts when B's broker has read its queue and says it waits (seconds
        # after the enqueue, in this busy process); B's share comes back as A's borrowed
        # sessions end (1.5-3 s each here).
        alone, both, queued = fleet.alone_then_both({"a": a_batch, "b": b_batch}, "a",
                                                    alone_s=6.0, both_s=15.0, skip_s=5.0)

        got = {job: [] for job in clients}
        want = {"a": len(a_batch), "b": len(b_batch)}

        def collected() -> bool:
            for job, c in clients.items():
                got[job] += c.results(500, timeout=0.2)
            return all(len(got[job]) >= want[job] for job in clients)

        assert wait_until(collected, timeout=150, every=0)
    capacity = KV * len(ENGINES)
    report = {"a_alone_of_capacity": round(alone["a"] / capacity, 3),
              "b_while_a_alone": alone["b"],
              "both_a_of_used": round(both["a"] / (both["a"] + both["b"]), 3),
              "both_b_of_used": round(both["b"] / (both["a"] + both["b"]), 3),
              "both_used_of_capacity": round((both["a"] + both["b"]) / capacity, 3),
              "both_a_part": round(both["a_part"] / capacity, 3),
              "both_b_part": round(both["b_part"] / capacity, 3),
              "both_a_waiting": round(both["a_waiting"], 2),
              "both_b_waiting": round(both["b_waiting"], 2)}
    print("shares:", report, "queued after the window:", queued)
    # Both contended on every engine through the window: each broker said it had work waiting
    # for each engine (a job whose sessions for one model ran out leaves those engines to the
    # other, and its part there is no longer its share).
    for job in SHARES:
        assert report[f"both_{job}_waiting"] >= len(ENGINES) - 0.1, report
    # A alone may plan against the whole fleet (B's share is lent), and holds more than it
    # does beside B. (How much of the fleet it fills is not checked: at this time scale the
    # one process running it all cannot keep the engines fed, and they sit about a third
    # full; benchmarks/shared_fleet.py measures the fill at a time scale it can drive:
    # docs/results/fleet.md.)
    assert alone["b"] == 0 and alone["a_part"] >= 0.98 * capacity, report
    assert alone["a"] > 1.5 * both["a"], report
    # Both queued: each may plan against its guaranteed share of the fleet, and holds about
    # that share of the KV in use.
    for job in SHARES:
        assert both[f"{job}_part"] / capacity >= SHARES[job] - 0.05, report
        assert report[f"both_{job}_of_used"] >= SHARES[job] - TOLERANCE, report
    # Every session ran once, on an engine serving its model and adapter.
    for job, batch in (("a", a_batch), ("b", b_batch)):
        by_id = {s.session_id: s for s in batch}
        assert sorted(r.session_id for r in got[job]) == sorted(by_id), job
        for r in got[job]:
            assert r.status == SessionState.done, (r.session_id, r.error)
            assert ENGINES[r.backend_id] == by_id[r.session_id].model, r.session_id
