"""Kubernetes manifests (deploy/k8s): what each overlay renders is valid against the Kubernetes
schemas, and runs the CLI the way the code expects (commands, options, settings, grace periods).

The overlays use only `resources`, `components` and strategic-merge `patches`, which `render()`
below reproduces in Python, so the schema validation and every invariant run without kubectl;
where kubectl is installed, `kubectl kustomize` must render exactly the same objects.

KEDA's `ScaledObject` (the autoscale overlays) is a custom resource, with no schema in
kubernetes-validate: `check_scaled_object` checks its shape field by field (KEDA's ScaledObject
specification), its HPA behavior is validated as the HorizontalPodAutoscaler KEDA makes of it,
and the tests at the end check it against the render it is in and the metrics the API exports.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os
import re
import shlex
import shutil
import subprocess
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from unittest import mock
from urllib.parse import urlparse

import click
import kubernetes_validate
import pytest
import typer.main
import yaml
from kubernetes_validate.utils import latest_version
from prometheus_client.parser import text_string_to_metric_families

from api.models import StatusPublic
from api.routers.metrics import metrics as metrics_route
from rollout_broker.cli import app
from broker.keys import Keys, check_backend_id
from broker.policies import live_policy_names
from broker.redis_conn import check_redis_url
from sim.engine.profiles import get_profile
from tests.api.helpers import sample_status
from workers.engine import ChildEngine, EngineSpec, engine_gpus
from workers.worker import Worker, WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("overlays/gpu", "overlays/gpu-tp4", "overlays/cpu", "overlays/gpu-autoscale",
            "overlays/cpu-autoscale")
# The overlays whose engine workers KEDA scales, and their StatefulSet.
AUTOSCALED = {"overlays/gpu-autoscale": "worker-gpu", "overlays/cpu-autoscale": "worker-sim"}
TARGETS = ("base", *OVERLAYS)
# The oldest Kubernetes the manifests target, and the newest whose schemas the package ships.
SCHEMA_VERSIONS = ("1.30.0", latest_version())
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
# The one container allowed a writable root filesystem (vLLM and its compilers write caches
# under $HOME and /tmp); worker-gpu.yaml says so beside the setting.
WRITABLE_ROOT = {("StatefulSet", "worker-gpu", "worker")}
CLI = typer.main.get_command(app)


# -- rendering ------------------------------------------------------------------------------------

def _load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


# The lists a strategic merge patch merges item by item, and the key that matches the items
# (the Kubernetes API's patchMergeKey); any other list in a patch replaces the target's whole.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
              "volumeMounts": "mountPath", "ports": "containerPort"}


def strategic_merge(target, patch, field: str = ""):
    """`patch` laid over `target` as a strategic merge patch does it, for the subset used here:
    maps merge key by key (a null value deletes the key), MERGE_KEYS lists item by item, other
    lists and values replace."""
    if isinstance(patch, dict) and isinstance(target, dict):
        assert not any(k.startswith("$") for k in patch), f"{field}: no $patch directives here"
        merged = {**target, **{k: strategic_merge(target.get(k), v, k)
                               for k, v in patch.items() if v is not None}}
        return {k: v for k, v in merged.items() if not (k in patch and patch[k] is None)}
    if isinstance(patch, list) and isinstance(target, list) and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        merged = list(target)
        for item in patch:
            at = [i for i, old in enumerate(merged) if old[key] == item[key]]
            if at:
                merged[at[0]] = strategic_merge(merged[at[0]], item, field)
            else:
                merged.append(item)
        return merged
    return patch


def render(directory: Path, kind: str = "Kustomization") -> list[dict]:
    """What `kubectl kustomize DIRECTORY` prints, for kustomizations that use only `resources`
    (files or directories), `components` and `patches` given as files of strategic merge
    patches (applied after both, as kustomize does). Anything else fails: teach it here
    first."""
    kfile = directory / "kustomization.yaml"
    k = yaml.safe_load(kfile.read_text(encoding="utf-8"))
    assert k.get("kind", "Kustomization") == kind, f"{kfile}: expected a {kind}"
    unknown = set(k) - {"apiVersion", "kind", "resources", "components", "patches"}
    assert not unknown, f"{kfile}: render() in this test knows resources, components and " \
                        f"patches only, not {sorted(unknown)}"
    objects: list[dict] = []
    for entry in k.get("resources", []):
        path = (directory / entry).resolve()
        objects += render(path) if path.is_dir() else _load_docs(path)
    for entry in k.get("components", []):
        objects += render((directory / entry).resolve(), kind="Component")
    ids = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(ids) == len(set(ids)), f"{directory}: an object appears twice: {sorted(ids)}"
    for entry in k.get("patches", []):
        assert set(entry) == {"path"}, f"{kfile}: render() knows patches given by path only"
        for patch in _load_docs(directory / entry["path"]):
            at = ids.index((patch["kind"], patch["metadata"]["name"]))
            objects[at] = strategic_merge(objects[at], patch)
    return objects


@cache
def rendered(target: str) -> tuple[dict, ...]:
    return tuple(render(K8S / target))


def by_id(objects) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def workloads(target: str) -> list[dict]:
    return [o for o in rendered(target) if o["kind"] in WORKLOAD_KINDS]


def containers(workload: dict) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def ours(container: dict) -> bool:
    """A rollout-broker image (its entrypoint is `rollout-broker`, so args are the command line)."""
    return container["image"].split(":")[0].rsplit("/", 1)[-1].startswith("rollout-broker")


def engine_workers(target: str) -> list[tuple[dict, dict]]:
    return [(w, c) for w in workloads(target) for c in containers(w)
            if ours(c) and c["args"][0] == "worker"]


def config_maps(target: str) -> dict[str, dict[str, str]]:
    return {o["metadata"]["name"]: o.get("data", {}) for o in rendered(target)
            if o["kind"] == "ConfigMap"}


def pod_name(workload: dict, ordinal: int = 0) -> str:
    name = workload["metadata"]["name"]
    return f"{name}-{ordinal}" if workload["kind"] == "StatefulSet" else f"{name}-5d8f7c9b4-x2x7q"


_K8S_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def container_env(target: str, workload: dict, container: dict, ordinal: int = 0) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom, then env in order with
    $(VAR) expanded from what is defined before. Secrets (not in the manifests) are stand-ins."""
    maps = config_maps(target)
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source["configMapRef"]
        assert ref["name"] in maps, f"envFrom: no ConfigMap {ref['name']!r} in {target}"
        env.update(maps[ref["name"]])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _K8S_REF.sub(lambda m: env.get(m[1], m[0]), var["value"])
            assert "$(" not in env[var["name"]], f"{var['name']}: an undefined $(VAR) in {var}"
            continue
        source = var["valueFrom"]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            assert ref["key"] in maps.get(ref["name"], {}), f"{var['name']}: no {ref} in {target}"
            env[var["name"]] = maps[ref["name"]][ref["key"]]
        elif "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            assert path in ("metadata.name", "status.podIP"), source
            env[var["name"]] = pod_name(workload, ordinal) if path == "metadata.name" \
                else f"10.0.0.{ordinal + 7}"  # a stand-in pod IP
        elif "secretKeyRef" in source:
            env[var["name"]] = f"secret-{source['secretKeyRef']['name']}"
        else:
            raise AssertionError(f"{var['name']}: a source this test does not know: {source}")
    return env


def cli_lines(container: dict) -> list[list[str]]:
    """Every `rollout-broker ...` command line the container runs: its args (the image's
    entrypoint is rollout-broker) and its exec probes, `sh -c "exec rollout-broker ..."` too."""
    lines = [list(container["args"])] if ours(container) else []
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = container.get(kind, {}).get("exec", {}).get("command")
        if not command:
            continue
        if command[:2] == ["sh", "-c"]:
            command = shlex.split(command[2])
            command = command[1:] if command[0] == "exec" else command
        if command[0] == "rollout-broker":
            lines.append(command[1:])
    return lines


def _shell_expand(arg: str, env: dict[str, str]) -> str:
    def var(m: re.Match) -> str:
        name = m[1] or m[2]
        assert name in env, f"{arg}: ${name} is not set in the container"
        return env[name]
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", var, arg)


def parse_cli(line: list[str], env: dict[str, str]) -> tuple[str, dict]:
    """Parse one command line with the CLI's own click command and this environment (the RB_
    variables are its options' defaults): (subcommand, the values it would run with)."""
    sub, *rest = [_shell_expand(a, env) for a in line]
    assert sub in CLI.commands, f"{line}: {sub!r} is not a rollout-broker command {sorted(CLI.commands)}"
    command = CLI.commands[sub]
    accepted = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
    for arg in rest:
        if arg.startswith("--"):
            assert arg.split("=")[0] in accepted, f"{line}: `rollout-broker {sub}` takes no {arg}"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RB_")}
    with mock.patch.dict(os.environ, {**clean, **env}, clear=True):
        try:
            ctx = command.make_context(f"rollout-broker {sub}", list(rest))
        except click.ClickException as exc:
            raise AssertionError(f"{line}: {exc.format_message()}") from None
    return sub, ctx.params


def cli_default(sub: str, name: str):
    return next(p.default for p in CLI.commands[sub].params if p.name == name)


# -- the manifests render and are valid -----------------------------------------------------------

def test_overlays_use_the_bundled_redis_and_their_workers():
    for target in OVERLAYS:
        ids = set(by_id(rendered(target)))
        assert {("StatefulSet", "redis"), ("Service", "redis"), ("Deployment", "broker"),
                ("Deployment", "api"), ("Deployment", "tools")} <= ids, target
    assert ("StatefulSet", "worker-gpu") in by_id(rendered("overlays/gpu"))
    assert ("StatefulSet", "worker-sim") in by_id(rendered("overlays/cpu"))


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_every_object_is_valid_against_the_kubernetes_schema(version):
    """Strict: an unknown or misspelt field fails too. Every YAML document under deploy/k8s (the
    Secret example included; patches, being partial, only as applied), and every object as each
    target renders it."""
    patches = {(kfile.parent / entry["path"]).resolve() for kfile in K8S.rglob("kustomization.yaml")
               for entry in yaml.safe_load(kfile.read_text(encoding="utf-8")).get("patches", [])
               if "path" in entry}
    documents = [(str(p.relative_to(K8S)), d) for p in sorted(K8S.rglob("*.yaml"))
                 if p.name != "kustomization.yaml" and p.resolve() not in patches
                 for d in _load_docs(p)]
    documents += [(target, o) for target in TARGETS for o in rendered(target)]
    assert len(documents) > 20
    for where, obj in documents:
        if obj["apiVersion"].startswith("keda.sh/"):  # a custom resource: no schema ships
            check_scaled_object(obj, where, version)
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{where}: {obj['kind']} {obj['metadata']['name']}: "
                                 f"{exc.message}") from None


@pytest.mark.skipif(shutil.which("kubectl") is None,
                    reason="kubectl is not installed: `kubectl kustomize` cannot render the overlays "
                           "(the Python rendering above is validated all the same)")
@pytest.mark.parametrize("target", TARGETS)
def test_kubectl_kustomize_renders_what_the_test_validates(target):
    out = subprocess.run(["kubectl", "kustomize", str(K8S / target)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert by_id(_docs(out.stdout)) == by_id(rendered(target))


def _docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


def test_the_secret_example_is_not_deployed():
    """The API token comes from a Secret the operator creates; the shipped one is a placeholder
    no kustomization includes, and no rendering carries a Secret."""
    example = _load_docs(K8S / "api-token-secret.example.yaml")[0]
    assert example["kind"] == "Secret"
    assert example["stringData"]["token"].startswith("REPLACE-ME")
    for target in TARGETS:
        assert not [o for o in rendered(target) if o["kind"] == "Secret"], target
    for kfile in K8S.rglob("kustomization.yaml"):
        assert "example" not in kfile.read_text(encoding="utf-8"), kfile


# -- every workload -------------------------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
def test_every_container_has_readiness_and_liveness_probes(target):
    for w in workloads(target):
        for c in containers(w):
            for probe in ("readinessProbe", "livenessProbe"):
                assert probe in c, f"{w['metadata']['name']}/{c['name']}: no {probe}"


@pytest.mark.parametrize("target", TARGETS)
def test_every_container_requests_resources_and_limits_its_memory(target):
    for w in workloads(target):
        for c in containers(w):
            where = f"{w['metadata']['name']}/{c['name']}"
            requests = c.get("resources", {}).get("requests", {})
            limits = c.get("resources", {}).get("limits", {})
            assert {"cpu", "memory"} <= set(requests), f"{where}: requests {requests}"
            assert "memory" in limits, f"{where}: no memory limit"
            assert _bytes(limits["memory"]) >= _bytes(requests["memory"]), where


def _bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(quantity[:-2]) * factor
    return int(quantity)


@pytest.mark.parametrize("target", TARGETS)
def test_every_container_runs_unprivileged(target):
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text(encoding="utf-8")
    image_uid = int(re.search(r"useradd --uid (\d+)", dockerfile)[1])
    for w in workloads(target):
        pod = w["spec"]["template"]["spec"]
        pod_sc = pod.get("securityContext", {})
        assert pod.get("enableServiceLinks") is False, \
            f"{w['metadata']['name']}: Service links would add variables such as RB_API_PORT"
        for c in containers(w):
            where = (w["kind"], w["metadata"]["name"], c["name"])
            sc = c.get("securityContext", {})
            assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, where
            uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
            # The images name their user (USER rb): the kubelet needs the number to check it.
            assert isinstance(uid, int) and uid > 0, where
            if ours(c):
                assert uid == image_uid, f"{where}: the images' user is uid {image_uid}"
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
            assert (sc.get("readOnlyRootFilesystem") is True) == (where not in WRITABLE_ROOT), \
                f"{where}: readOnlyRootFilesystem (allowed off only for {WRITABLE_ROOT})"


@pytest.mark.parametrize("target", TARGETS)
def test_selectors_services_and_ports_fit_together(target):
    objects = by_id(rendered(target))
    pods = [w["spec"]["template"] for w in workloads(target)]
    for w in workloads(target):
        selector = w["spec"]["selector"]["matchLabels"]
        assert selector.items() <= w["spec"]["template"]["metadata"]["labels"].items(), w["metadata"]
        others = [o for o in workloads(target) if o is not w]
        assert not [o for o in others
                    if selector.items() <= o["spec"]["template"]["metadata"]["labels"].items()], \
            f"{w['metadata']['name']}: its selector also matches another workload's pods"
        if w["kind"] == "StatefulSet":
            governing = objects.get(("Service", w["spec"]["serviceName"]))
            assert governing and governing["spec"].get("clusterIP") == "None", w["metadata"]
    for (kind, name), svc in objects.items():
        if kind != "Service":
            continue
        matched = [p for p in pods if svc["spec"]["selector"].items() <= p["metadata"]["labels"].items()]
        assert matched, f"Service {name}: selects no pod"
        for port in svc["spec"]["ports"]:
            for p in matched:
                named = {cp.get("name") for c in p["spec"]["containers"] for cp in c.get("ports", [])}
                assert port["targetPort"] in named, f"Service {name}: no port {port['targetPort']}"


# -- the CLI: every command, option and setting ---------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
def test_every_command_line_is_one_the_cli_accepts(target):
    """Each container's args and each exec probe name a real subcommand and only options it
    takes, and parse with the container's environment (RB_ settings, $(VAR) expanded)."""
    for path in ("docker/Dockerfile", "docker/Dockerfile.gpu"):
        assert 'ENTRYPOINT ["rollout-broker"]' in (ROOT / path).read_text(encoding="utf-8"), path
    seen = set()
    for w in workloads(target):
        for c in containers(w):
            if ours(c):
                assert "command" not in c, f"{w['metadata']['name']}: keep the image's entrypoint"
            env = container_env(target, w, c)
            for line in cli_lines(c):
                sub, params = parse_cli(line, env)
                seen.add(sub)
                if "redis_url" in params:
                    check_redis_url(params["redis_url"])
                if "namespace" in params:
                    Keys(params["namespace"])  # raises unless Redis keys accept the namespace
                if sub == "broker":
                    assert params["policy"] in live_policy_names(), params["policy"]
                if sub == "probe":
                    assert params["role"] in ("broker", "worker", "tools"), line
    assert {"broker", "api", "tools", "probe"} <= seen, seen


def test_broker_runs_two_replicas_active_and_standby():
    for target in TARGETS:
        broker = by_id(rendered(target))[("Deployment", "broker")]
        assert broker["spec"]["replicas"] == 2
        (c,) = containers(broker)
        assert c["args"][0] == "broker"
        assert ["broker"] in [line[:2][1:] for line in cli_lines(c) if line[0] == "probe"]
        pdb = by_id(rendered(target))[("PodDisruptionBudget", "broker")]
        assert pdb["spec"]["minAvailable"] == 1


def test_api_probes_and_token():
    for target in TARGETS:
        objects = by_id(rendered(target))
        api = objects[("Deployment", "api")]
        (c,) = containers(api)
        sub, params = parse_cli(c["args"], container_env(target, api, c))
        assert sub == "api" and params["host"] == "0.0.0.0"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports[c["readinessProbe"]["httpGet"]["port"]] == params["port"] == 8080
        assert ports[c["livenessProbe"]["httpGet"]["port"]] == params["port"]
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        token = [e for e in c.get("env", []) if e["name"] == "RB_API_TOKEN"]
        assert len(token) == 1 and "value" not in token[0], "RB_API_TOKEN must come from a Secret"
        ref = token[0]["valueFrom"]["secretKeyRef"]
        assert ref["name"] and ref["key"] and not ref.get("optional", False)
        for name, data in config_maps(target).items():
            assert "RB_API_TOKEN" not in data, f"ConfigMap {name} carries the token"
        svc = objects[("Service", "rollout-broker-api")]
        assert [p["port"] for p in svc["spec"]["ports"]] == [8080]


def test_the_gateway_reaches_every_workers_engine():
    """The session gateway (docs/gateway.md): token from the Secret, its Service on 8100; every
    engine worker's engine listens on the pod's IP and the worker advertises that URL."""
    for target in TARGETS:
        objects = by_id(rendered(target))
        gw = objects[("Deployment", "gateway")]
        (c,) = containers(gw)
        sub, params = parse_cli(c["args"], container_env(target, gw, c))
        assert sub == "gateway" and params["host"] == "0.0.0.0" and params["port"] == 8100
        token = [e for e in c["env"] if e["name"] == "RB_GATEWAY_TOKEN"]
        assert len(token) == 1 and "secretKeyRef" in token[0]["valueFrom"]
        svc = objects[("Service", "rollout-broker-gateway")]
        assert [p["port"] for p in svc["spec"]["ports"]] == [8100]
    for target in OVERLAYS:
        for workload, c in engine_workers(target):
            env = container_env(target, workload, c)
            sub, params = parse_cli(c["args"], env)
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert params["engine_host"] == "0.0.0.0" and params["engine_port"] == ports["engine"]
            assert params["advertise_url"] == f"http://10.0.0.7:{ports['engine']}"


# -- engine workers -------------------------------------------------------------------------------

def _shutdown_budget_s(params: dict) -> float:
    """The longest a worker takes to stop after SIGTERM, from the code's own numbers: the drain
    grace (--drain-grace, default in the CLI), the hand-back time after it, the withdraw deadline
    (Worker.run) and the engine child's stop grace."""
    handoff = next(f.default for f in dataclasses.fields(WorkerSettings) if f.name == "handoff_s")
    withdraw = re.search(r"_withdraw\(deadline_s=([\d.]+)\)", inspect.getsource(Worker.run))
    assert withdraw, "Worker.run no longer calls _withdraw(deadline_s=...): update this test"
    engine_stop = inspect.signature(ChildEngine.stop).parameters["grace_s"].default
    return params["drain_grace"] + handoff + float(withdraw[1]) + engine_stop


@pytest.mark.parametrize("target", OVERLAYS)
def test_worker_pods_outlast_the_drain(target):
    assert cli_default("worker", "drain_grace") == WorkerSettings.__dataclass_fields__[
        "drain_grace_s"].default
    for w, c in engine_workers(target):
        _, params = parse_cli(c["args"], container_env(target, w, c))
        grace = w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > params["drain_grace"], f"{w['metadata']['name']}: {grace} s"
        assert grace > _shutdown_budget_s(params), \
            f"{w['metadata']['name']}: {grace} s < {_shutdown_budget_s(params)} s to drain and stop"


@pytest.mark.parametrize("target", OVERLAYS)
def test_worker_startup_probe_waits_out_the_engine_start(target):
    """A worker beats only once its engine answers, which it waits for up to --ready-timeout:
    the startup probe must not restart the pod before."""
    for w, c in engine_workers(target):
        _, params = parse_cli(c["args"], container_env(target, w, c))
        s = c["startupProbe"]
        window = s.get("initialDelaySeconds", 0) + s["periodSeconds"] * s["failureThreshold"]
        assert window > params["ready_timeout"], f"{w['metadata']['name']}: {window} s"


@pytest.mark.parametrize("target", OVERLAYS)
def test_workers_are_statefulsets_with_stable_backend_ids_their_probes_use(target):
    workers = engine_workers(target)
    assert len(workers) == 1, target
    for w, c in workers:
        assert w["kind"] == "StatefulSet"
        ids = set()
        for ordinal in (0, 1, 99):
            env = container_env(target, w, c, ordinal)
            _, params = parse_cli(c["args"], env)
            ids.add(check_backend_id(params["backend_id"]))
            assert pod_name(w, ordinal) in params["backend_id"]
            probes = [parse_cli(line, env)[1] for line in cli_lines(c)[1:]]
            assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(c)
            assert len(probes) == 3 and all(p["role"] == "worker" for p in probes)
            assert {p["backend_id"] for p in probes} == {params["backend_id"]}
            assert params["tools"] == "rq"
        assert len(ids) == 3


def test_gpu_worker_one_gpu_per_pod_with_vllm_from_the_config_map():
    (w, c), = engine_workers("overlays/gpu")
    assert w["metadata"]["name"] == "worker-gpu"
    assert c["image"].startswith("rollout-broker-gpu:")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["resources"].get("requests", {}).get("nvidia.com/gpu", 1) == 1
    env = container_env("overlays/gpu", w, c)
    _, params = parse_cli(c["args"], env)
    spec = EngineSpec.parse(params["engine"])
    vllm = config_maps("overlays/gpu")["rollout-broker-vllm"]
    assert spec.kind == "vllm" and spec.target == vllm["RB_MODEL"]
    assert spec.args == tuple(shlex.split(vllm["RB_VLLM_ARGS"]))
    # The model cache where the GPU image puts it (HF_HOME), on a volume per pod.
    hf_home = re.search(r"ENV HF_HOME=(\S+)", (ROOT / "docker" / "Dockerfile.gpu").read_text())[1]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts[hf_home] in {t["metadata"]["name"] for t in w["spec"]["volumeClaimTemplates"]}
    assert "/dev/shm" in mounts
    for other in workloads("overlays/gpu"):
        for o in containers(other):
            if o is not c:
                assert "nvidia.com/gpu" not in str(o["resources"]), other["metadata"]["name"]


@pytest.mark.parametrize("target", OVERLAYS)
def test_every_vllm_worker_gets_the_gpus_its_engine_uses(target):
    """nvidia.com/gpu is set in the StatefulSet, the parallel sizes in RB_VLLM_ARGS: they must
    agree (tensor × pipeline × data parallel size), or the worker refuses to start
    (workers.engine.check_gpu_count) with GPUs reserved and idle."""
    for w, c in engine_workers(target):
        _, params = parse_cli(c["args"], container_env(target, w, c))
        spec = EngineSpec.parse(params["engine"])
        resources = c["resources"]
        if spec.kind != "vllm":
            assert "nvidia.com/gpu" not in str(resources), w["metadata"]["name"]
            continue
        gpus = engine_gpus(spec.args)
        assert resources["limits"]["nvidia.com/gpu"] == gpus, (target, spec.args)
        assert resources["requests"].get("nvidia.com/gpu", gpus) == gpus, (target, spec.args)


def test_a_tensor_parallel_worker_has_the_room_its_ranks_need():
    """overlays/gpu-tp4: four GPUs for one tensor-parallel engine, memory-backed /dev/shm for
    NCCL and vLLM's rank-to-rank queue within the memory limit, CPU for four ranks, and a
    model cache that holds Llama-3.1-70B's 141 GB of BF16 weights."""
    (w, c), = engine_workers("overlays/gpu-tp4")
    _, params = parse_cli(c["args"], container_env("overlays/gpu-tp4", w, c))
    spec = EngineSpec.parse(params["engine"])
    assert spec.args == ("--tensor-parallel-size", "4") and engine_gpus(spec.args) == 4
    pod = w["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    [shm] = [v for v in pod["volumes"] if v["name"] == mounts["/dev/shm"]]
    assert shm["emptyDir"]["medium"] == "Memory"
    limits, requests = c["resources"]["limits"], c["resources"]["requests"]
    shm_size = _bytes(shm["emptyDir"]["sizeLimit"])
    assert _bytes(limits["memory"]) >= _bytes(requests["memory"]) + shm_size
    assert int(requests["cpu"]) >= 4 * limits["nvidia.com/gpu"]
    [cache] = w["spec"]["volumeClaimTemplates"]
    assert mounts["/home/rb/.cache/huggingface"] == cache["metadata"]["name"]
    assert _bytes(cache["spec"]["resources"]["requests"]["storage"]) > 141e9
    # Everything else is the one-GPU overlay's worker: the patches touch only these fields.
    one_gpu = by_id(rendered("overlays/gpu"))[("StatefulSet", "worker-gpu")]
    assert one_gpu["spec"]["template"]["spec"]["containers"][0]["args"] == c["args"]
    assert one_gpu["spec"]["template"]["spec"]["containers"][0]["env"] == c["env"]


def test_cpu_workers_run_simulated_engines_without_gpus():
    (w, c), = engine_workers("overlays/cpu")
    assert w["metadata"]["name"] == "worker-sim" and w["spec"]["replicas"] >= 2
    _, params = parse_cli(c["args"], container_env("overlays/cpu", w, c))
    spec = EngineSpec.parse(params["engine"])
    assert spec.kind == "sim"
    get_profile(spec.target)
    assert "nvidia.com/gpu" not in yaml.safe_dump(list(rendered("overlays/cpu")))


# -- Redis: bundled by a component, or external by RB_REDIS_URL ----------------------------------

def test_bundled_redis_is_durable_and_is_what_rb_redis_url_names():
    for target in OVERLAYS:
        objects = by_id(rendered(target))
        redis = objects[("StatefulSet", "redis")]
        (c,) = containers(redis)
        assert c["image"] == "redis:7.2-alpine"
        args = " ".join(c["args"])
        assert "--appendonly yes" in args and "--appendfsync always" in args
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert mounts["/data"] in {t["metadata"]["name"] for t in redis["spec"]["volumeClaimTemplates"]}
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["exec"]["command"] == ["redis-cli", "ping"]
        url = urlparse(config_maps(target)["rollout-broker"]["RB_REDIS_URL"])
        svc = objects[("Service", url.hostname)]
        assert svc["spec"]["clusterIP"] == "None" and svc["metadata"]["name"] == "redis"
        assert url.port in [p["port"] for p in svc["spec"]["ports"]]


def test_redis_is_external_without_the_component():
    """The base has no Redis: only RB_REDIS_URL says where it is, and every rollout-broker
    container reads it from the one ConfigMap."""
    base = rendered("base")
    assert not [o for o in base if "redis" in o["metadata"]["name"]]
    assert "redis://" not in yaml.safe_dump([o for o in base if o["kind"] != "ConfigMap"])
    for target in TARGETS:
        for w in workloads(target):
            for c in containers(w):
                if ours(c):
                    refs = [s["configMapRef"]["name"] for s in c.get("envFrom", [])]
                    assert "rollout-broker" in refs, f"{w['metadata']['name']}/{c['name']}"
                    assert "RB_REDIS_URL" not in {e["name"] for e in c.get("env", [])}


# -- autoscaling: KEDA ScaledObjects (a custom resource: checked here, field by field) -----------

# The scalers these manifests may use, with the metadata keys KEDA's documentation marks
# required for each (keda.sh/docs/2.15/scalers/): a trigger of another type fails until it is
# added here with its own.
KEDA_SCALERS = {
    "prometheus": {"serverAddress", "query", "threshold"},
    "redis-streams": {"stream"},
}
# ScaledObject fields (keda.sh/docs/2.15/reference/scaledobject-spec/), for a strict check.
SCALED_OBJECT_SPEC = {"scaleTargetRef", "pollingInterval", "cooldownPeriod",
                      "initialCooldownPeriod", "idleReplicaCount", "minReplicaCount",
                      "maxReplicaCount", "fallback", "advanced", "triggers"}
SCALE_TARGET_REF = {"apiVersion", "kind", "name", "envSourceContainerName"}
ADVANCED = {"restoreToOriginalReplicaCount", "horizontalPodAutoscalerConfig", "scalingModifiers"}
HPA_CONFIG = {"name", "behavior"}
TRIGGER = {"type", "name", "metadata", "metricType", "useCachedMetrics", "authenticationRef"}
# PromQL words that are not metric names (aggregations and functions are followed by "(").
PROMQL_KEYWORDS = {"and", "or", "unless", "on", "ignoring", "by", "without", "bool", "offset",
                   "group_left", "group_right"}


def _strict(obj: dict, allowed: set[str], where: str) -> None:
    assert isinstance(obj, dict), f"{where}: not a mapping"
    unknown = set(obj) - allowed
    assert not unknown, f"{where}: unknown fields {sorted(unknown)}"


def check_scaled_object(obj: dict, where: str, version: str) -> None:
    """A KEDA ScaledObject as the CRD takes it: known fields only, the types it declares
    (trigger metadata is string to string), and its HPA behavior valid as the
    HorizontalPodAutoscaler KEDA builds from it (autoscaling/v2)."""
    name = f"{where}: ScaledObject {obj.get('metadata', {}).get('name')}"
    assert obj["apiVersion"] == "keda.sh/v1alpha1" and obj["kind"] == "ScaledObject", name
    _strict(obj, {"apiVersion", "kind", "metadata", "spec"}, name)
    spec = obj["spec"]
    _strict(spec, SCALED_OBJECT_SPEC, f"{name}: spec")
    _strict(spec["scaleTargetRef"], SCALE_TARGET_REF, f"{name}: scaleTargetRef")
    assert isinstance(spec["scaleTargetRef"]["name"], str), name
    for field in ("pollingInterval", "cooldownPeriod", "minReplicaCount", "maxReplicaCount"):
        assert isinstance(spec.get(field, 0), int) and spec.get(field, 0) >= 0, f"{name}: {field}"
    advanced = spec.get("advanced", {})
    _strict(advanced, ADVANCED, f"{name}: advanced")
    hpa = advanced.get("horizontalPodAutoscalerConfig", {})
    _strict(hpa, HPA_CONFIG, f"{name}: horizontalPodAutoscalerConfig")
    as_hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
              "metadata": {"name": hpa.get("name", f"keda-hpa-{obj['metadata']['name']}")},
              "spec": {"scaleTargetRef": {k: v for k, v in spec["scaleTargetRef"].items()
                                          if k != "envSourceContainerName"},
                       "minReplicas": max(1, spec.get("minReplicaCount", 0)),
                       "maxReplicas": spec.get("maxReplicaCount", 100),
                       "behavior": hpa.get("behavior", {})}}
    try:
        kubernetes_validate.validate(as_hpa, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise AssertionError(f"{name}: its HPA behavior: {exc.message}") from None
    triggers = spec["triggers"]
    assert isinstance(triggers, list) and triggers, f"{name}: no trigger"
    names = [t.get("name", t.get("type")) for t in triggers]
    assert len(names) == len(set(names)), f"{name}: two triggers named alike: {names}"
    for t in triggers:
        _strict(t, TRIGGER, f"{name}: trigger {t.get('name')}")
        assert t.get("metricType", "AverageValue") in ("AverageValue", "Value"), t
        meta = t["metadata"]
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()), \
            f"{name}: trigger {t.get('name')}: metadata values must be strings: {meta}"


def scaled_objects(target: str) -> list[dict]:
    return [o for o in rendered(target) if o["kind"] == "ScaledObject"]


@cache
def api_sample_names() -> frozenset[str]:
    """Every sample name GET /metrics serves: the API's route itself, run on a status with a
    workload that has sessions waiting and a backend (its Redis reader stood in for)."""
    status = sample_status()

    class Reader:
        async def read(self) -> StatusPublic:
            return status

    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(last_status=None)))
    response = asyncio.run(metrics_route(request, Reader()))
    families = text_string_to_metric_families(response.body.decode())
    return frozenset(s.name for f in families for s in f.samples)


def promql_metrics(query: str) -> set[str]:
    """The metric names a PromQL expression selects: its identifiers less label matchers,
    range selectors, functions and aggregations (followed by "(") and keywords."""
    bare = re.sub(r'\{[^}]*\}|\[[^\]]*\]|"[^"]*"', " ", query)
    assert bare.count("(") == bare.count(")"), f"unbalanced parentheses: {query}"
    words = re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?", bare)
    return {w for w, call in words if not call and w not in PROMQL_KEYWORDS}


def test_only_the_autoscale_overlays_have_scaled_objects():
    """KEDA's CRD must be in the cluster for a ScaledObject to apply: the plain overlays have
    none, each autoscale overlay one, for its engine workers."""
    for target in TARGETS:
        objects = scaled_objects(target)
        if target not in AUTOSCALED:
            assert not objects, target
            continue
        (so,) = objects
        assert so["metadata"]["name"] == AUTOSCALED[target]


@pytest.mark.parametrize("target", AUTOSCALED)
def test_the_scaled_object_targets_a_worker_statefulset_of_the_same_render(target):
    """It names a StatefulSet of the render it is in, one that runs engine workers, and that
    StatefulSet leaves its replica count to the HPA (a count in it would be set again by
    every `kubectl apply -k`, fighting the autoscaler)."""
    (so,) = scaled_objects(target)
    ref = so["spec"]["scaleTargetRef"]
    assert (ref.get("apiVersion"), ref.get("kind")) == ("apps/v1", "StatefulSet"), ref
    sts = by_id(rendered(target)).get(("StatefulSet", ref["name"]))
    assert sts is not None, f"{target}: no StatefulSet {ref['name']} to scale"
    assert [w for w, _ in engine_workers(target)] == [sts], f"{target}: not the engine workers"
    assert "replicas" not in sts["spec"], f"{target}: {ref['name']} still sets its replicas"


@pytest.mark.parametrize("target", AUTOSCALED)
def test_scaled_object_triggers_are_keda_scalers_with_their_metadata(target):
    (so,) = scaled_objects(target)
    for t in so["spec"]["triggers"]:
        assert t["type"] in KEDA_SCALERS, f"{t['type']}: not a scaler this test knows"
        missing = KEDA_SCALERS[t["type"]] - set(t["metadata"])
        assert not missing, f"trigger {t.get('name')}: {t['type']} requires {sorted(missing)}"
        if t["type"] == "prometheus":
            assert urlparse(t["metadata"]["serverAddress"]).scheme in ("http", "https"), t
            assert float(t["metadata"]["threshold"]) > 0, t
            # A lost scrape is an error (the HPA holds the replicas), not a 0 that scales in.
            assert t["metadata"].get("ignoreNullValues") == "false", t


@pytest.mark.parametrize("target", AUTOSCALED)
def test_scaled_object_queries_name_metrics_the_api_exports(target):
    """Every metric a Prometheus trigger queries is one GET /metrics serves, and the triggers
    follow the queue's depth and its oldest pending age."""
    exported = api_sample_names()
    used: set[str] = set()
    (so,) = scaled_objects(target)
    for t in so["spec"]["triggers"]:
        if t["type"] != "prometheus":
            continue
        names = promql_metrics(t["metadata"]["query"])
        assert names, t["metadata"]["query"]
        assert names <= exported, f"trigger {t['name']}: not exported: {sorted(names - exported)}"
        used |= names
    assert {"rb_queue_depth", "rb_oldest_pending_age_seconds"} <= used, used


@pytest.mark.parametrize("target", AUTOSCALED)
def test_scale_in_goes_one_drain_at_a_time_within_the_pods_grace(target):
    """Replica bounds are sane and never reach 0 (the API is ready only while a worker beats);
    scale-in removes one pod at a time, no sooner than the previous pod's drain may last (its
    termination grace), and the grace covers the worker's whole drain."""
    (so,) = scaled_objects(target)
    spec = so["spec"]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"], spec
    assert "idleReplicaCount" not in spec
    assert spec.get("cooldownPeriod", 300) >= spec.get("pollingInterval", 30)
    sts = by_id(rendered(target))[("StatefulSet", spec["scaleTargetRef"]["name"])]
    grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    ((_, c),) = engine_workers(target)
    _, params = parse_cli(c["args"], container_env(target, sts, c))
    assert grace > params["drain_grace"] and grace > _shutdown_budget_s(params), grace
    down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert down.get("selectPolicy", "Max") != "Disabled"
    one_pod = [p for p in down["policies"] if p["type"] == "Pods" and p["value"] == 1]
    if down.get("selectPolicy", "Max") == "Max":
        assert one_pod == down["policies"], f"a policy removes more than one pod: {down}"
    assert one_pod and all(p["periodSeconds"] >= grace for p in one_pod), (down, grace)
