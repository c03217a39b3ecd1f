"""Redis Cluster without a cluster: every key of a namespace is in one hash slot, cluster URLs
are read (or refused) as documented, and RQ is kept off a cluster. The cluster itself runs in
tests/broker/test_cluster.py."""

from __future__ import annotations

import inspect

import pytest
from redis.crc import key_slot

from broker.keys import Keys
from broker.redis_cluster import (
    ClusterClient,
    ClusterUnavailable,
    _stream_keys,
    parse_cluster_url,
)
from broker.redis_conn import check_redis_url, connect, durability, is_outage
from workers.tools import RqExecutor, tools_redis_url

SAMPLE_ARGS = {"workload": "rlvr", "backend_id": "gpu-0.a", "session_id": "s:1.x-2",
               "executor_id": "3f2a9c1b0d4e"}


def every_key(keys: Keys) -> dict[str, str]:
    """Each key `Keys` builds (properties, and methods called with a sample id); a new method
    with an argument this does not know fails here rather than going unchecked."""
    out = {}
    for name, member in inspect.getmembers(Keys):
        if name.startswith("_") or name == "prefix":
            continue
        if isinstance(member, property):
            out[name] = getattr(keys, name)
        elif inspect.isfunction(member):
            params = list(inspect.signature(member).parameters)[1:]
            assert len(params) == 1 and params[0] in SAMPLE_ARGS, (name, params)
            out[name] = getattr(keys, name)(SAMPLE_ARGS[params[0]])
    return out


@pytest.mark.parametrize("namespace", ["default", "job-7", "a.b_c", "x" * 64])
def test_every_key_of_a_namespace_is_in_the_slot_of_its_tag(namespace):
    keys = every_key(Keys(namespace))
    assert len(keys) >= 20  # the whole schema, not a part of it
    slot = key_slot(namespace.encode())  # a key's slot is its {tag}'s
    assert {name: key_slot(k.encode()) for name, k in keys.items()} == \
        {name: slot for name in keys}


def test_namespaces_spread_over_slots():
    slots = {key_slot(Keys(f"job{i}").results.encode()) for i in range(100)}
    assert len(slots) > 90  # (a key without the tag would pin them all to its own)
    assert key_slot(Keys("a").results.encode()) != key_slot(Keys("b").results.encode())


def test_a_cluster_url_is_read_with_its_nodes_and_options():
    t = parse_cluster_url("redis+cluster://u:p%40ss@10.0.0.1:7000,10.0.0.2,[::1]:7002/0"
                          "?socket_timeout=5&client_name=rb&min_replicas=0",
                          own_params=("min_replicas",))
    assert t.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002))
    assert t.options == {"username": "u", "password": "p@ss", "socket_timeout": 5.0,
                         "client_name": "rb"}
    assert t.params == {"min_replicas": "0"}
    assert parse_cluster_url("rediss+cluster://h:1").options == {"ssl": True}
    check_redis_url("redis+cluster://127.0.0.1:7000,127.0.0.1:7001")
    assert durability("redis+cluster://127.0.0.1:7000").replicas == 0


@pytest.mark.parametrize("url, says", [
    ("redis+cluster://", "no cluster node address"),
    ("redis+cluster://h:0", "port"),
    ("redis+cluster://h:x", "port"),
    ("redis+cluster://h/2", "database 0 only"),
    ("redis+cluster://h?db=1", "unknown parameter 'db'"),
    ("redis+cluster://h?socket_timeout=soon", "socket_timeout"),
    ("redis+cluster://h?min_replicas=1", "not supported on a Redis Cluster"),
])
def test_a_bad_cluster_url_is_refused_saying_why(url, says):
    with pytest.raises(ValueError, match="redis_url: ") as err:
        check_redis_url(url)
    assert says in str(err.value)


def test_stream_keys_are_read_from_xread_and_xreadgroup_themselves():
    assert _stream_keys(("XREAD", "COUNT", 5, "STREAMS", "a", "b", "0", "$")) == ["a", "b"]
    assert _stream_keys(("XREADGROUP", "GROUP", "g", "c", "BLOCK", 10, "STREAMS", b"s", ">")) \
        == [b"s"]
    assert _stream_keys(("GET", "k")) is None


def test_a_cluster_client_is_made_while_the_cluster_is_down_and_waits_it_out():
    client = connect("redis+cluster://127.0.0.1:1")  # nothing listens on port 1
    assert isinstance(client, ClusterClient)
    client.register_script("return 1")  # registering needs no connection
    with pytest.raises(ClusterUnavailable) as err:
        client.ping()
    assert is_outage(err.value)  # the loops wait it out, as any outage
    client.close()


def test_rq_tool_queues_stay_off_a_cluster():
    plain, cluster = "redis://127.0.0.1:6379/0", "redis+cluster://127.0.0.1:7000"
    assert tools_redis_url(plain) == plain
    assert tools_redis_url(cluster, plain) == plain  # their own Redis beside the cluster
    with pytest.raises(ValueError, match=r"^redis_url: rq cannot run on a Redis Cluster.*"
                                         r"--tools-redis-url"):
        tools_redis_url(cluster)
    with pytest.raises(ValueError, match="^tools_redis_url: rq cannot run"):
        tools_redis_url(plain, cluster)
    with pytest.raises(ValueError, match="^tools_redis_url: rq cannot run"):
        RqExecutor(cluster, "ns")


CLUSTER = "redis+cluster://127.0.0.1:7000,127.0.0.1:7001"


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["tools", "--redis-url", CLUSTER], {}, "redis_url: rq cannot run on a Redis Cluster"),
    (["tools"], {"RB_REDIS_URL": "redis://x:1/0", "RB_TOOLS_REDIS_URL": CLUSTER},
     "tools_redis_url: rq cannot run on a Redis Cluster"),
    (["worker", "--backend-id", "w", "--engine", "sim:h100-8b", "--tools", "rq"],
     {"RB_REDIS_URL": CLUSTER}, "redis_url: rq cannot run on a Redis Cluster"),
    (["probe", "tools", "--tools-redis-url", CLUSTER], {},
     "tools_redis_url: rq cannot run on a Redis Cluster"),
    (["broker", "--redis-url", CLUSTER + "?min_replicas=1"], {},
     "durable writes (WAIT) are not supported on a Redis Cluster"),
])
def test_rq_on_a_cluster_url_stops_at_start_with_one_line(argv, env, message, monkeypatch):
    import subprocess

    from typer.testing import CliRunner

    from rollout_broker.cli import app

    def refuse(*args, **kwargs):
        raise AssertionError(f"started something: {args[:1]}")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(ClusterClient, "__init__", refuse)
    res = CliRunner().invoke(app, argv, env=env)
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rollout-broker {argv[0]}: ") \
        and message in lines[0], res.output
    assert "--tools-redis-url" in lines[0] or "WAIT" in lines[0]
