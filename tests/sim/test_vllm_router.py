"""The real vLLM Router (`vllm-router`, cache_aware) in front of three sim engines.

A 10-turn chat goes through the router; each turn's prompt is the previous history plus the reply
plus a new user message. The router's prefix tree should keep the conversation on one engine, so
from turn 2 on its prompt hits that engine's prefix cache — checked through the engines' own
`vllm:prefix_cache_hits_total`, summed over the three.

Engines run as `rollout-broker sim-engine` subprocesses (python -m broker.cli), so this also
covers the CLI. Every process is killed in `finally`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker.binaries import find_executable

ROOT = Path(__file__).resolve().parents[2]
PROFILE, MODEL = "h100-8b", "sim-llama3-8b"
STARTUP_TIMEOUT_S = 60.0

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what} not ready at {url} after {STARTUP_TIMEOUT_S}s")


@contextmanager
def processes() -> Iterator[list[subprocess.Popen]]:
    procs: list[subprocess.Popen] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


def start_engine(procs: list[subprocess.Popen], seed: int) -> str:
    port = free_port()
    cmd = [sys.executable, "-m", "broker.cli", "sim-engine", "--port", str(port), "--profile",
           PROFILE, "--time-scale", "100", "--seed", str(seed)]
    procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)}))
    url = f"http://127.0.0.1:{port}"
    wait_ready(url + "/health", procs[-1], f"sim engine on {port}")
    return url


def start_router(procs: list[subprocess.Popen], workers: list[str]) -> str:
    router = find_executable("vllm-router")
    assert router is not None, "vllm-router is not installed (pip install vllm-router==0.1.17)"
    port = free_port()
    cmd = [router, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
           "--policy", "cache_aware", "--worker-startup-check-interval", "1",
           "--worker-startup-timeout-secs", str(int(STARTUP_TIMEOUT_S)),
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           "--log-level", "warning"]
    procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    url = f"http://127.0.0.1:{port}"
    wait_ready(url + "/health", procs[-1], "vllm-router")
    return url


def engine_counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    wanted = {"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
              "vllm:request_success_total"}
    out = dict.fromkeys(wanted, 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in wanted:
                out[s.name] += s.value
    return out


SYSTEM = ("You are a careful assistant for a long-running agent. Keep the whole history in mind, "
          "answer each question briefly, and refer back to earlier turns when useful. ") * 8


def test_router_cache_aware_keeps_conversation_on_one_sim_server_hitting_its_cache() -> None:
    with processes() as procs:
        engines = [start_engine(procs, seed) for seed in (1, 2, 3)]
        router = start_router(procs, engines)
        client = openai.OpenAI(base_url=router + "/v1", api_key="unused", timeout=60,
                               max_retries=0)
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "turn 1: what is a rollout?"}]
        hits_after: list[float] = []
        cached: list[int] = []
        for turn in range(1, 11):
            resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48,
                                                  extra_body={"sim_output_len": 24})
            assert resp.usage.completion_tokens == 24
            cached.append(resp.usage.prompt_tokens_details.cached_tokens)
            hits_after.append(sum(engine_counters(e)["vllm:prefix_cache_hits_total"]
                                  for e in engines))
            messages += [{"role": "assistant", "content": resp.choices[0].message.content},
                         {"role": "user", "content": f"turn {turn + 1}: and then?"}]

        assert hits_after[0] == 0 and cached[0] == 0  # fresh engines: nothing to hit
        assert all(later > earlier for earlier, later in zip(hits_after, hits_after[1:])), \
            hits_after  # every follow-up turn hits
        assert hits_after[-1] == sum(cached)  # the engines' counters agree with the responses
        served = [engine_counters(e)["vllm:request_success_total"] for e in engines]
        assert sorted(served) == [0, 0, 10], served  # cache-aware kept the conversation together
