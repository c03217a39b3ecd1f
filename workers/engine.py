"""The worker's engine: attach to one that runs, or start `vllm serve` / the simulator as a child.

ENGINE strings (`rollout-broker worker --engine ...`):
- `attach:URL`            an engine already serving vLLM's HTTP API at URL; never stopped by us.
- `vllm:MODEL [ARGS...]`  `vllm serve MODEL --host 127.0.0.1 --port P ARGS...` as a child (the GPU
                          path); ready when GET /health answers 200; stopped on exit.
- `sim:PROFILE`           `rollout-broker sim-engine --profile PROFILE --port P --time-scale X` as a
                          child (sim/server), started and stopped the same way.

A child runs in the worker's process group (so a Ctrl-C or a `killpg` of the worker reaches it)
and, on Linux, gets PR_SET_PDEATHSIG: if the worker is killed with SIGKILL, the kernel sends the
engine SIGTERM, so no engine outlives its worker.

Capacity comes from the engine itself: `vllm:cache_config_info` (num_gpu_blocks × block_size)
on /metrics and `max_model_len` on /v1/models.
"""

from __future__ import annotations

import ctypes
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from broker.binaries import find_executable
from broker.heartbeat import EngineMetrics
from broker.redis_server import free_port

_PR_SET_PDEATHSIG = 1
_MAX_GAUGES = frozenset({"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"})


@dataclass(frozen=True, slots=True)
class EngineSpec:
    kind: str  # 'attach' | 'vllm' | 'sim'
    target: str  # URL, model name or profile
    args: tuple[str, ...] = ()  # extra `vllm serve` arguments

    @classmethod
    def parse(cls, text: str) -> EngineSpec:
        kind, sep, rest = text.partition(":")
        rest = rest.strip()
        if not sep or kind not in ("attach", "vllm", "sim") or not rest:
            raise ValueError(f"engine: {text!r} must be attach:URL, vllm:MODEL [ARGS] or sim:PROFILE")
        if kind == "vllm":
            model, *args = shlex.split(rest)
            return cls(kind, model, tuple(args))
        return cls(kind, rest)


def vllm_command(model: str, port: int, args: tuple[str, ...] = (), executable: str = "vllm"
                 ) -> list[str]:
    """`vllm serve` on a loopback port. The caller's ARGS come last, so they win on repeats,
    except --host/--port, which the worker owns (it must know where to connect)."""
    for a in args:
        if a in ("--port", "--host") or a.startswith(("--port=", "--host=")):
            raise ValueError(f"engine: {a} is chosen by the worker; leave it out of the vLLM args")
    return [executable, "serve", model, "--host", "127.0.0.1", "--port", str(port), *args]


def sim_command(profile: str, port: int, time_scale: float = 1.0, kv_tokens: int | None = None,
                seed: int = 0) -> list[str]:
    cmd = [sys.executable, "-m", "broker.cli", "sim-engine", "--host", "127.0.0.1",
           "--port", str(port), "--profile", profile, "--time-scale", repr(time_scale),
           "--seed", str(seed)]
    if kv_tokens is not None:
        cmd += ["--kv-tokens", str(kv_tokens)]
    return cmd


def _die_with_parent() -> None:
    """preexec_fn: the kernel sends SIGTERM to the child when the worker thread that forked it
    dies (Linux only; elsewhere the worker's `finally` is the only guard)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class ChildEngine:
    """An engine process we started; `stop()` ends it (SIGTERM, then SIGKILL after a grace)."""

    command: list[str]
    url: str
    process: subprocess.Popen | None = field(default=None, repr=False)

    def start(self, ready_timeout_s: float = 60.0, env: dict[str, str] | None = None) -> ChildEngine:
        self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL,
                                        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
                                        env=env)
        try:
            wait_healthy(self.url, ready_timeout_s, self.process)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, grace_s: float = 5.0) -> None:
        p = self.process
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def wait_healthy(url: str, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    """Poll GET /health until it answers 200; fail early if the child process exits."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as http:
        while True:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"engine: {' '.join(process.args)} exited with code "
                                   f"{process.returncode} before {url}/health answered")
            try:
                if http.get(f"{url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine: {url}/health did not answer within {timeout_s:.0f}s")
            time.sleep(0.1)


@dataclass(frozen=True, slots=True)
class EngineHandle:
    """Where the engine answers, and the child to stop (None when attached)."""

    url: str
    child: ChildEngine | None = None

    def close(self) -> None:
        if self.child is not None:
            self.child.stop()


def open_engine(spec: EngineSpec, time_scale: float = 1.0, kv_tokens: int | None = None,
                seed: int = 0, ready_timeout_s: float = 120.0,
                vllm_executable: str | None = None) -> EngineHandle:
    if spec.kind == "attach":
        url = spec.target.rstrip("/")
        wait_healthy(url, ready_timeout_s)
        return EngineHandle(url)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if spec.kind == "vllm":
        exe = vllm_executable or find_executable("vllm")
        if exe is None:
            raise RuntimeError("engine: vllm: no `vllm` program beside this Python or on PATH; "
                               "pip install vllm, or run the engine yourself and use attach:URL")
        cmd = vllm_command(spec.target, port, spec.args, exe)
    else:
        cmd = sim_command(spec.target, port, time_scale, kv_tokens, seed)
    return EngineHandle(url, ChildEngine(cmd, url).start(ready_timeout_s))


# -- what the engine says about itself -------------------------------------------------------

@dataclass(frozen=True, slots=True)
class EngineScrape:
    """One /metrics read: the heartbeat's metrics plus the counters the worker reports on."""

    metrics: EngineMetrics
    generation_tokens_total: int
    prompt_tokens_total: int
    num_gpu_blocks: int | None
    block_size: int | None

    @property
    def capacity_tokens(self) -> int | None:
        if self.num_gpu_blocks is None or self.block_size is None:
            return None
        return self.num_gpu_blocks * self.block_size


def parse_metrics(text: str) -> EngineScrape:
    """vLLM's Prometheus text → EngineScrape. Counters and queue gauges are summed over the
    `engine` label (data parallel); KV usage is the fullest engine's."""
    values: dict[str, float] = {}
    blocks = block_size = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                nb, bs = sample.labels.get("num_gpu_blocks"), sample.labels.get("block_size")
                if nb and nb.isdigit() and bs and bs.isdigit():
                    blocks = (blocks or 0) + int(nb)
                    block_size = int(bs)
                continue
            if sample.name.endswith("_created"):
                continue
            if sample.name in _MAX_GAUGES:
                values[sample.name] = max(values.get(sample.name, 0.0), sample.value)
            else:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    kv = values.get("vllm:kv_cache_usage_perc", values.get("vllm:gpu_cache_usage_perc", 0.0))
    metrics = EngineMetrics(
        kv_usage=min(1.0, max(0.0, kv)),
        running=int(values.get("vllm:num_requests_running", 0)),
        waiting=int(values.get("vllm:num_requests_waiting", 0)),
        preemptions_total=int(values.get("vllm:num_preemptions_total", 0)),
        prefix_queries_total=int(values.get("vllm:prefix_cache_queries_total", 0)),
        prefix_hits_total=int(values.get("vllm:prefix_cache_hits_total", 0)),
    )
    return EngineScrape(metrics=metrics,
                        generation_tokens_total=int(values.get("vllm:generation_tokens_total", 0)),
                        prompt_tokens_total=int(values.get("vllm:prompt_tokens_total", 0)),
                        num_gpu_blocks=blocks, block_size=block_size)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model: str
    max_model_len: int
    capacity_tokens: int
    vocab_size: int | None = None  # when the model card says (the simulator's does; vLLM's not)


def read_engine_info(url: str, timeout_s: float = 10.0) -> EngineInfo:
    with httpx.Client(timeout=timeout_s) as http:
        models = http.get(f"{url}/v1/models").raise_for_status().json()["data"]
        scrape = parse_metrics(http.get(f"{url}/metrics").raise_for_status().text)
    if not models:
        raise RuntimeError(f"engine: {url}/v1/models lists no model")
    card = models[0]
    if scrape.capacity_tokens is None:
        raise RuntimeError(f"engine: {url}/metrics has no vllm:cache_config_info with "
                           "num_gpu_blocks and block_size")
    vocab = card.get("vocab_size")
    return EngineInfo(model=card["id"], max_model_len=int(card.get("max_model_len") or 0)
                      or scrape.capacity_tokens, capacity_tokens=scrape.capacity_tokens,
                      vocab_size=int(vocab) if isinstance(vocab, int) and vocab > 0 else None)

