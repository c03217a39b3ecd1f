"""The Grafana dashboard and Prometheus config of the compose `observability` profile: the
dashboard JSON is a loadable dashboard, and every metric its PromQL names is one the code
exports (the API's /metrics, or the broker's and workers' own registry)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client.metrics_core import Metric

from api.routers.metrics import StatusCollector
from broker.metrics import REGISTRY
from tests.api.helpers import sample_status

ROOT = Path(__file__).resolve().parents[2]
OBS = ROOT / "docker" / "observability"
DASHBOARD = OBS / "grafana" / "dashboards" / "rollout-broker.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
            "gauge": ("",), "unknown": ("",)}


def sample_names(families: list[Metric]) -> set[str]:
    return {f.name + sfx for f in families for sfx in SUFFIXES[f.type]}


def exported() -> set[str]:
    """Every sample name the code can export, labelled metrics included before first use."""
    status = sample_status()
    return sample_names(list(StatusCollector(status).collect())) | sample_names(
        list(REGISTRY.collect()))


def exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def test_the_dashboard_is_a_loadable_grafana_dashboard():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and len(ids) >= 12
    for p in dash["panels"]:
        assert p["type"] in ("timeseries", "stat") and p["title"] and p["targets"], p
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        assert p["datasource"]["uid"] == "prometheus"
        for t in p["targets"]:
            assert t["refId"] and t["expr"].count("(") == t["expr"].count(")"), t
    provisioned = yaml.safe_load((OBS / "grafana/provisioning/datasources/prometheus.yml")
                                 .read_text())
    assert [d["uid"] for d in provisioned["datasources"]] == ["prometheus"]


def test_every_metric_the_dashboard_queries_is_exported():
    names = exported()
    used = {(title, m) for title, e in exprs() for m in re.findall(r"\brb_[a-z0-9_]+", e)}
    assert used
    missing = sorted((title, m) for title, m in used if m not in names)
    assert not missing, missing


def test_the_dashboard_answers_the_operators_questions():
    """Busy? (queue, admissions, tokens), starved? (queue wait, drift), the KV gap, what
    failed, and which broker is active with which policy."""
    text = " ".join(e for _, e in exprs())
    for metric in ("rb_queue_depth", "rb_broker_queue_wait_seconds_bucket",
                   "rb_broker_admissions_total", "rb_backend_reserved_tokens",
                   "rb_backend_kv_usage_ratio", "rb_backend_preemptions_total",
                   "rb_backend_prefix_cache_hits_total", "rb_mixture_drift",
                   "rb_worker_generated_tokens_total", "rb_worker_session_duration_seconds_bucket",
                   "rb_worker_handed_back_sessions_total", "rb_broker_active"):
        assert metric in text, metric


def test_prometheus_scrapes_the_ports_the_services_serve():
    prom = yaml.safe_load((OBS / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert jobs["api"]["static_configs"][0]["targets"] == ["api:8080"]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    for job in ("broker", "worker"):
        [sd] = jobs[job]["dns_sd_configs"]
        assert set(sd["names"]) <= set(services), job
        assert sd["port"] == 9100
    broker_cmd = services["broker"]["command"]
    assert broker_cmd[broker_cmd.index("--metrics-port") + 1] == "9100"
    assert compose["x-worker-env"]["RB_METRICS_PORT"] == "9100"
