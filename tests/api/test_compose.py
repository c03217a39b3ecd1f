"""docker-compose.yml is valid for each profile (`docker compose config -q`; no engine needed),
and each GPU worker reserves the GPUs its engine uses."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from workers.engine import EngineSpec, engine_gpus

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


# What the compose file reads from the environment besides RB_*: kept out of the tests' runs.
HOST_VARIABLES = ("GPUS_PER_WORKER",)


def run(*args: str, token: str | None = "t0ken",
        variables: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RB_") and k not in HOST_VARIABLES}
    env.update(variables or {})
    if token is not None:
        env["RB_API_TOKEN"] = token
    return subprocess.run([*COMPOSE, "-f", str(ROOT / "docker-compose.yml"), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("profile", [None, "gpu", "multi-gpu", "cpu", "observability"])
def test_config_is_valid(profile):
    args = ["--profile", profile] if profile else []
    if profile == "observability":
        args = ["--profile", "cpu", "--profile", "observability"]
    r = run(*args, "config", "-q")
    assert r.returncode == 0, r.stderr


GPU_WORKERS = [f"worker-gpu{i}" for i in range(8)]


def services_of(*profiles: str, variables: dict[str, str] | None = None) -> dict:
    args = [a for p in profiles for a in ("--profile", p)]
    r = run(*args, "config", variables=variables)
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)["services"]


def shell_words(command: list[str]) -> list[str]:
    """A service's command as its shell splits it (quoted arguments whole, `$$` as `$`)."""
    return shlex.split(" ".join(command).replace("$$", "$"))


def engine_of(svc: dict) -> EngineSpec:
    """The worker's --engine as the container's /bin/sh expands it in the service's
    environment (variables and $((arithmetic)) included)."""
    words = shell_words(svc["command"])
    template = words[words.index("--engine") + 1]
    env = {k: "" if v is None else str(v) for k, v in svc["environment"].items()}
    out = subprocess.run(["sh", "-c", f'printf %s "{template}"'],
                         env={**env, "PATH": "/bin:/usr/bin"}, capture_output=True, text=True,
                         timeout=10, check=True)
    return EngineSpec.parse(out.stdout)


@pytest.mark.parametrize("profile, service, engine", [("gpu", "worker-gpu0", "vllm:"),
                                                      ("cpu", "sim-worker", "sim:h100-8b")])
def test_profiles_bring_their_workers(profile, service, engine):
    services = services_of(profile)
    assert {"redis", "broker", "broker-standby", "api", "tools", service} <= set(services)
    cmd = " ".join(services[service]["command"])
    assert "rollout-broker worker" in cmd and "--backend-id" in cmd and "--tools rq" in cmd
    assert engine.split(":")[0] + ":" in cmd
    if profile == "cpu":
        assert services[service]["environment"]["RB_SIM_PROFILE"] == "h100-8b"


def test_each_gpu_worker_has_its_own_gpu_and_backend_id():
    services = services_of("gpu")
    ids, devices = set(), set()
    for i, name in enumerate(GPU_WORKERS):
        svc = services[name]
        [device] = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == [str(i)] and "count" not in device, (name, device)
        assert "--backend-id \"$$RB_BACKEND_ID\"" in " ".join(svc["command"]) or \
            '--backend-id "$RB_BACKEND_ID"' in " ".join(svc["command"])
        ids.add(svc["environment"]["RB_BACKEND_ID"])
        devices.add(device["device_ids"][0])
    assert ids == {f"node0-gpu{i}" for i in range(8)} and len(devices) == 8
    for n in (1, 2, 4, 8):  # the gpuN profile starts exactly the first N
        assert {s for s in GPU_WORKERS if f"gpu{n}" in services[s]["profiles"]} == \
            set(GPU_WORKERS[:n])
    assert all("gpu" in services[s]["profiles"] for s in GPU_WORKERS)


@pytest.mark.parametrize("variables", [
    {},
    {"GPUS_PER_WORKER": "4"},
    {"GPUS_PER_WORKER": "8", "RB_DATA_PARALLEL_SIZE": "2"},
    {"GPUS_PER_WORKER": "2", "RB_VLLM_ARGS": "--max-model-len 32768"},
])
def test_every_gpu_worker_reserves_the_gpus_its_engine_uses(variables):
    """The invariant the worker enforces when it starts (workers.engine.check_gpu_count): the
    GPUs a service reserves are tensor × data parallel size of its engine's vLLM arguments."""
    services = services_of("gpu", "multi-gpu", variables=variables)
    for name in [*GPU_WORKERS, "worker-multi-gpu"]:
        svc = services[name]
        [device] = svc["deploy"]["resources"]["reservations"]["devices"]
        reserved = len(device["device_ids"]) if "device_ids" in device else int(device["count"])
        spec = engine_of(svc)
        assert spec.kind == "vllm" and spec.target == "Qwen/Qwen3-8B", (name, spec)
        assert reserved == engine_gpus(spec.args), (name, reserved, spec.args)
        if "RB_VLLM_ARGS" in variables:
            assert spec.args[-2:] == tuple(shlex.split(variables["RB_VLLM_ARGS"])), name
    multi = services["worker-multi-gpu"]
    assert multi["profiles"] == ["multi-gpu"] and multi["ipc"] == "host"
    assert multi["environment"]["RB_BACKEND_ID"] not in {
        services[n]["environment"]["RB_BACKEND_ID"] for n in GPU_WORKERS}


def _seconds(text: str) -> float:
    """Compose durations as v1 and v2 print them: 60s, 1m, 1m30s, 10m0s."""
    total, num = 0.0, ""
    for ch in str(text):
        if ch.isdigit() or ch == ".":
            num += ch
        else:
            total += float(num) * {"h": 3600, "m": 60, "s": 1}[ch]
            num = ""
    return total + (float(num) if num else 0.0)


def test_workers_get_to_finish_their_drain_before_a_sigkill():
    from workers.worker import WorkerSettings

    w = WorkerSettings(backend_id="x", redis_url="redis://127.0.0.1:6379/0")
    drain = w.drain_grace_s + w.handoff_s + 10.0  # withdraw waits up to 10 s (worker.py)
    services = services_of("gpu", "multi-gpu", "cpu")
    for name in [*GPU_WORKERS, "worker-multi-gpu", "sim-worker"]:
        assert _seconds(services[name]["stop_grace_period"]) > drain, name


def test_every_long_running_service_has_a_healthcheck_and_rotated_logs():
    services = services_of("gpu", "multi-gpu", "cpu")
    for name, svc in services.items():
        assert "healthcheck" in svc, name
        assert svc["logging"]["options"]["max-size"], name
    assert "/readyz" in " ".join(services["api"]["healthcheck"]["test"])
    for name in ("broker", "broker-standby", "tools", "sim-worker", "worker-multi-gpu",
                 *GPU_WORKERS):
        assert "rollout-broker probe" in " ".join(services[name]["healthcheck"]["test"]), name


def test_commands_use_options_the_cli_has():
    """Every `--option` compose passes to a subcommand exists on that subcommand."""
    import typer.main

    from rollout_broker.cli import app

    group = typer.main.get_command(app)
    services = services_of("gpu", "multi-gpu", "cpu")
    commands = []
    for name, svc in services.items():
        if not svc.get("image", "").startswith("rollout-broker"):
            continue  # redis, prometheus, grafana
        commands.append((name, svc["command"]))
        test = svc["healthcheck"]["test"]
        if "rollout-broker" in " ".join(test):
            commands.append((f"{name} healthcheck", test[1:]))
    for name, command in commands:
        words = shell_words(command)
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


def test_the_gateway_profile_reaches_the_workers_engines():
    """--profile gateway adds the session gateway; every worker's engine listens on the compose
    network and the worker advertises where (docs/gateway.md)."""
    services = services_of("cpu", "gateway")
    gw = services["gateway"]
    assert gw["command"][:3] == ["gateway", "--host", "0.0.0.0"]
    assert gw["environment"]["RB_GATEWAY_TOKEN"] == "t0ken"  # the API's, for the trainer's
    assert gw["profiles"] == ["gateway"]  # only with its profile
    for name, svc in {**services_of("gpu"), **services}.items():
        if "rollout-broker worker" in " ".join(svc.get("command") or []):
            assert svc["environment"]["RB_ENGINE_HOST"] == "0.0.0.0", name
            assert '--advertise-url "http://$$HOSTNAME:$$RB_ENGINE_PORT"' in \
                " ".join(svc["command"]), name
