"""docker-compose.yml is valid for each profile (`docker compose config -q`; no engine needed)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _compose() -> list[str] | None:
    """The compose CLI: the docker plugin (v2), else the standalone `docker-compose`."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


COMPOSE = _compose()
pytestmark = [
    pytest.mark.skipif(COMPOSE is None, reason="no compose CLI: neither `docker compose` nor "
                       "`docker-compose` (apt-get install docker-compose) is installed"),
    pytest.mark.timeout(120),
]


def run(*args: str, token: str | None = "t0ken") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RB_")}
    if token is not None:
        env["RB_API_TOKEN"] = token
    return subprocess.run([*COMPOSE, "-f", str(ROOT / "docker-compose.yml"), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("profile", [None, "gpu", "cpu"])
def test_config_is_valid(profile):
    args = ["--profile", profile] if profile else []
    r = run(*args, "config", "-q")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("profile, service, engine", [("gpu", "worker", "vllm:"),
                                                      ("cpu", "sim-worker", "sim:h100-8b")])
def test_profiles_bring_their_workers(profile, service, engine):
    r = run("--profile", profile, "config")
    assert r.returncode == 0, r.stderr
    services = yaml.safe_load(r.stdout)["services"]
    assert {"redis", "broker", "broker-standby", "api", "tools", service} <= set(services)
    cmd = " ".join(services[service]["command"])
    assert "rollout-broker worker" in cmd and "--backend-id" in cmd and "--tools rq" in cmd
    assert engine.split(":")[0] + ":" in cmd
    env = services[service]["environment"]
    if profile == "gpu":
        devices = services[service]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    else:
        assert env["RB_SIM_PROFILE"] == "h100-8b"


def test_commands_use_options_the_cli_has():
    """Every `--option` compose passes to a subcommand exists on that subcommand."""
    import typer.main

    from broker.cli import app

    group = typer.main.get_command(app)
    services = yaml.safe_load(run("--profile", "gpu", "--profile", "cpu", "config").stdout)["services"]
    for name, svc in services.items():
        if name == "redis":
            continue
        words = " ".join(svc["command"]).replace('"', " ").split()
        if "rollout-broker" in words:
            words = words[words.index("rollout-broker") + 1:]
        sub = group.commands[words[0]]
        known = {o for p in sub.params for o in getattr(p, "opts", ()) if o.startswith("--")}
        passed = {w for w in words if w.startswith("--")}
        assert passed <= known, (name, passed - known)


def test_redis_keeps_an_append_only_file_on_a_volume():
    services = yaml.safe_load(run("config").stdout)["services"]
    assert "--appendonly" in services["redis"]["command"]
    # v1 prints "redis-data:/data:rw", v2 a mapping with source and target
    assert any(v.get("target") == "/data" if isinstance(v, dict) else ":/data" in v
               for v in services["redis"]["volumes"])


def test_the_api_needs_a_token():
    r = run("config", "-q", token=None)
    assert r.returncode != 0
    assert "RB_API_TOKEN" in r.stderr
