"""Two namespaces on two shards of a local 3-primary Redis Cluster, at once, through the cluster
URL: per namespace a broker, a worker on a simulated engine, a trainer client (one blocking, one
asyncio) and the status API. Both complete, each session exactly once, and no CROSSSLOT (nor
redis-py's "keys in different slots") error is raised, logged, or counted by any node.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import redis
from fastapi.testclient import TestClient
from redis.crc import key_slot

from api.app import create_app
from api.settings import ApiSettings
from broker.binaries import find_executable
from broker.client import AsyncRolloutClient, RolloutClient
from broker.keys import Keys
from broker.plans import AsyncRunner, Cmd, Runner, ScriptCall, batch
from broker.policies import make_policy
from broker.redis_conn import Outage, connect, connect_async, is_outage
from broker.redis_server import find_redis_server_binary, free_port
from broker.session import Session, SessionState
from sim.server.testing import running_engine
from tests.broker.helpers import BrokerThread, wait_until
from tests.workers.helpers import WorkerThread, prompt

pytestmark = [pytest.mark.redis, pytest.mark.integration, pytest.mark.timeout(600)]

# What a key spread over two slots looks like: the server's reply, redis-py's own checks.
SLOT_ERRORS = ("CROSSSLOT", "same slot", "same key slot", "CrossSlot")


@dataclass
class LocalCluster:
    ports: list[int]
    workdir: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports[:2])

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)

    def owner(self, key: str) -> int:
        """The port of the primary serving `key`'s slot (CLUSTER SLOTS)."""
        slot = key_slot(key.encode())
        with self.node(self.ports[0]) as r:
            for start, end, primary, *_ in r.execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    return int(primary[1])
        raise AssertionError(f"slot {slot} is not served")

    def crossslot_errors(self) -> dict[int, int]:
        """CROSSSLOT replies each node has sent (INFO errorstats)."""
        out = {}
        for p in self.ports:
            with self.node(p) as r:
                stats = r.info("errorstats")
            out[p] = int(stats.get("errorstat_CROSSSLOT", {}).get("count", 0))
        return out

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _cluster_ports(n: int) -> list[int]:
    """`n` free ports whose cluster bus ports (+10000) are free too."""
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        if p + 10000 > 65535 or p in ports:
            continue
        try:
            import socket
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 10000))
        except OSError:
            continue
        ports.append(p)
    return ports


def start_cluster(workdir: str, primaries: int = 3) -> LocalCluster:
    exe, cli = find_redis_server_binary(), find_executable("redis-cli")
    if exe is None or cli is None:
        pytest.skip("redis-server and redis-cli are needed to form a local Redis Cluster")
    cluster = LocalCluster(ports=_cluster_ports(primaries), workdir=workdir)
    try:
        for p in cluster.ports:
            d = os.path.join(workdir, str(p))
            os.makedirs(d, exist_ok=True)
            cluster.procs.append(subprocess.Popen(
                [exe, "--port", str(p), "--bind", "127.0.0.1", "--dir", d,
                 "--cluster-enabled", "yes", "--cluster-config-file", f"{d}/nodes-{p}.conf",
                 "--appendonly", "no", "--save", "", "--loglevel", "warning"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        def answers(p: int) -> bool:
            try:
                with cluster.node(p) as r:
                    return bool(r.ping())
            except redis.RedisError:
                return False

        assert wait_until(lambda: all(answers(p) for p in cluster.ports), timeout=20)
        subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in cluster.ports),
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)

        def ok(p: int) -> bool:
            with cluster.node(p) as r:
                info = r.cluster("INFO")  # parsed: {"cluster_state": "ok", ...}
            return info.get("cluster_state") == "ok" \
                and int(info.get("cluster_known_nodes", 0)) == primaries

        assert wait_until(lambda: all(ok(p) for p in cluster.ports), timeout=30)
    except BaseException:
        cluster.close()
        raise
    return cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[LocalCluster]:
    c = start_cluster(str(tmp_path_factory.mktemp("cluster")))
    yield c
    c.close()


def namespaces_on_two_shards(cluster: LocalCluster) -> tuple[str, str]:
    owners: dict[int, str] = {}
    for i in range(200):
        ns = f"job{i}"
        owners.setdefault(cluster.owner(Keys(ns).results), ns)
        if len(owners) == 2:
            a, b = owners.values()
            return a, b
    raise AssertionError("no two namespaces on different shards")


def rollouts(prefix: str, n: int) -> list[Session]:
    """Single-turn rlvr/rlhf sessions and two-turn agentic ones calling the inline sim tool."""
    out = []
    for i in range(n):
        if i % 3 == 2:
            out.append(Session(session_id=f"{prefix}-a{i}", workload="agentic",
                               prompt_token_ids=prompt(i, 96), max_tokens=12, max_turns=2,
                               metadata={"tool": "sim", "sim_turns": 2,
                                         "sim_tool_latency_s": "10",
                                         "sim_observation_tokens": "8"}))
        else:
            out.append(Session(session_id=f"{prefix}-s{i}", workload="rlvr" if i % 3 else "rlhf",
                               prompt_token_ids=prompt(i, 64), max_tokens=12))
    return out


def slot_errors(records: list[logging.LogRecord]) -> list[str]:
    """Log records (with their exceptions) that speak of keys in two slots, one line each."""
    out = []
    for r in records:
        exc = r.exc_info[1] if r.exc_info else None
        texts = (r.getMessage(), f"{type(exc).__name__}: {exc}" if exc else "", r.exc_text or "")
        hit = next((line.strip() for t in texts for line in t.splitlines()
                    if any(e in line for e in SLOT_ERRORS)), None)
        if hit is not None:
            out.append(f"{r.name}: {r.getMessage()}: {hit}")
    return out


N = 300  # sessions per namespace


def test_two_namespaces_on_two_shards_run_at_once(cluster, caplog):
    caplog.set_level(logging.WARNING)
    caplog.set_level(logging.DEBUG, logger="rollout_broker")
    ns_a, ns_b = namespaces_on_two_shards(cluster)
    assert cluster.owner(Keys(ns_a).results) != cluster.owner(Keys(ns_b).results)
    url = cluster.url
    batch_a, batch_b = rollouts("A", N), rollouts("B", N)
    got_a: list = []
    got_b: list = []
    errors: list[Exception] = []
    stop = threading.Event()  # a failure seen early ends the trainers' waits

    def sync_trainer() -> None:  # namespace A: the blocking client
        try:
            with RolloutClient(url, ns_a) as client:
                client.enqueue(batch_a)
                deadline = time.monotonic() + 240
                while len(got_a) < N and time.monotonic() < deadline and not stop.is_set():
                    got_a.extend(client.results(64, timeout=0.5))
        except Exception as exc:  # noqa: BLE001 (reported by the test's thread)
            errors.append(exc)

    async def async_trainer() -> None:  # namespace B: the asyncio client
        async with AsyncRolloutClient(url, ns_b) as client:
            await client.enqueue(batch_b[: N // 2])
            await client.enqueue(batch_b[N // 2:])
            deadline = time.monotonic() + 240
            while len(got_b) < N and time.monotonic() < deadline and not stop.is_set():
                got_b.extend(await client.results(64, timeout=0.5))

    def run_async_trainer() -> None:
        try:
            asyncio.run(async_trainer())
        except Exception as exc:  # noqa: BLE001 (reported by the test's thread)
            errors.append(exc)

    processes: list = []
    trainers: list[threading.Thread] = []
    with running_engine(time_scale=200.0, kv_tokens=60_000) as engine_a, \
            running_engine(time_scale=200.0, kv_tokens=60_000) as engine_b, \
            TestClient(create_app(ApiSettings(redis_url=url, namespace=ns_a))) as api_a, \
            TestClient(create_app(ApiSettings(redis_url=url, namespace=ns_b))) as api_b:
        apis = ((ns_a, api_a), (ns_b, api_b))
        try:
            for ns, engine in ((ns_a, engine_a), (ns_b, engine_b)):
                processes.append(WorkerThread(url, ns, "w0", engine.url).start())
                processes.append(BrokerThread(url, ns, make_policy("least_loaded"),
                                              lease_s=2.0).start())
            # The first sessions of each namespace go in through its API (a RolloutClient
            # inside it); the trainers then enqueue the whole batch (those are duplicates).
            for (ns, api), sent in zip(apis, (batch_a, batch_b)):
                body = {"sessions": [s.model_dump(mode="json", exclude_none=True)
                                     for s in sent[:30]]}
                r = api.post("/v1/sessions", json=body)
                assert r.status_code == 200 and len(r.json()["enqueued"]) == 30, r.text
            trainers = [threading.Thread(target=sync_trainer, daemon=True),
                        threading.Thread(target=run_async_trainer, daemon=True)]
            for t in trainers:
                t.start()
            statuses: dict[str, dict] = {}
            while any(t.is_alive() for t in trainers):
                assert all(p.thread.is_alive() for p in processes)  # nobody crashed
                assert slot_errors(caplog.records) == []
                for ns, api in apis:
                    r = api.get("/v1/status")
                    assert r.status_code == 200, r.text
                    statuses[ns] = r.json()
                time.sleep(0.5)
            assert not errors, errors
            assert all(p.thread.is_alive() for p in processes)
            final = {ns: api.get("/v1/status").json() for ns, api in apis}
            ready = {ns: api.get("/readyz").status_code for ns, api in apis}
        finally:
            stop.set()
            for t in trainers:
                t.join(timeout=60)
            for p in reversed(processes):
                p.stop()

    for sent, got in ((batch_a, got_a), (batch_b, got_b)):
        assert sorted(r.session_id for r in got) == sorted(s.session_id for s in sent)
        assert all(r.status == SessionState.done for r in got), [r.error for r in got if r.error]
    for ns in (ns_a, ns_b):
        assert final[ns]["namespace"] == ns
        assert sum(w["finished_total"] for w in final[ns]["workloads"]) == N
        assert [b["backend_id"] for b in final[ns]["backends"]] == ["w0"]
        assert statuses[ns]["namespace"] == ns
        assert ready[ns] == 200
    assert slot_errors(caplog.records) == []
    assert cluster.crossslot_errors() == {p: 0 for p in cluster.ports}
    # Each namespace's keys live on its own shard, and only there.
    for ns in (ns_a, ns_b):
        owner = cluster.owner(Keys(ns).results)
        for p in cluster.ports:
            with cluster.node(p) as r:
                n = sum(1 for _ in r.scan_iter(match=f"rb:{{{ns}}}:*", count=1000))
            assert (n > 0) == (p == owner), (ns, p, n)


def test_cluster_pipelines_transactions_and_scripts_answer_as_a_plain_client(cluster):
    """What the code relies on, on both clients: MULTI/EXEC and plain pipelines reply as a
    single command does (redis-py's cluster transactions do not parse their replies, or choke
    on them), Lua scripts run in pipelines (loaded on every primary first), and a script cache
    emptied under a running client is an outage the next try gets over."""
    k = Keys("parity")
    sync = connect(cluster.url)
    sync.hset(k.mixture, mapping={"rlvr": "0.5"})
    sync.sadd(k.workloads, "rlvr")
    sync.xadd(k.results, {"result": "{}"})
    calls = [Cmd("hgetall", (k.mixture,)), Cmd("smembers", (k.workloads,)),
             Cmd("xread", ({k.results: "0", k.events: "0"},)),
             Cmd("hmget", (k.mixture, "rlvr", "x")), Cmd("xrevrange", (k.results,), {"count": 1}),
             ScriptCall("lease_renew", [k.lease], ["nobody", 1000])]
    direct = [getattr(sync, c.name)(*c.args, **c.kwargs) for c in calls[:-1]] + [0]

    def plan(tx):
        return (yield batch(calls, transaction=tx))

    log = logging.getLogger("test")
    try:
        runner = Runner(sync, Outage("sync", log))
        for tx in (False, True):
            assert runner.run(plan(tx)) == direct, tx

        async def on_asyncio() -> None:
            client = connect_async(cluster.url)
            try:
                arunner = AsyncRunner(client, Outage("async", log))
                for tx in (True, False):  # a transaction first: on a client not connected yet
                    assert await arunner.run(plan(tx)) == direct, tx
                for p in cluster.ports:
                    with cluster.node(p) as r:
                        r.script_flush()
                with pytest.raises(Exception) as err:
                    await arunner.run(plan(False))
                assert is_outage(err.value)  # NOSCRIPT: waited out like a restart
                assert await arunner.run(plan(True)) == direct
            finally:
                await client.aclose()

        asyncio.run(on_asyncio())
        for p in cluster.ports:
            with cluster.node(p) as r:
                r.script_flush()
        with pytest.raises(Exception) as err:
            runner.run(plan(False))
        assert is_outage(err.value)
        assert runner.run(plan(True)) == direct
        assert runner.run(plan(False)) == direct
    finally:
        sync.close()
