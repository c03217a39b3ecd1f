"""`rollout-broker`: one console script; each subcommand imports its module only when run."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

app = typer.Typer(
    name="rollout-broker",
    help="Serve mixed LLM RL rollouts (RLVR, RLHF, agentic) on a vLLM fleet with MISA-T admission.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def main() -> None:
    """Keeps subcommands named (`rollout-broker sim-engine ...`) while there is only one."""


@app.command("sim-engine")
def sim_engine(
    port: Annotated[int, typer.Option(help="TCP port to serve vLLM's HTTP API on")] = 8000,
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    profile: Annotated[str, typer.Option(help="engine profile (GPU × model), see sim/engine/profiles.py")] = "h200-30b-a3b",
    time_scale: Annotated[float, typer.Option(help="simulated seconds per wall second")] = 1.0,
    kv_tokens: Annotated[Optional[int], typer.Option(help="override the profile's KV capacity in tokens")] = None,
    seed: Annotated[int, typer.Option(help="seed for end-of-sequence lengths and token ids")] = 0,
    model_name: Annotated[Optional[str], typer.Option(help="served model name (default: the profile's)")] = None,
) -> None:
    """Serve a simulated vLLM v1 engine over vLLM's OpenAI-compatible HTTP API."""
    from sim.server.app import serve

    serve(host=host, port=port, profile=profile, time_scale=time_scale, kv_tokens=kv_tokens,
          seed=seed, model_name=model_name)


@app.command("broker")
def broker(
    redis_url: Annotated[str, typer.Option(help="Redis server URL")] = "redis://127.0.0.1:6379/0",
    namespace: Annotated[str, typer.Option(help="key namespace (one RL job)")] = "default",
    policy: Annotated[str, typer.Option(help="policy name, or package.module:factory")] = "least_loaded",
    lease_s: Annotated[float, typer.Option(help="lease period; a standby takes over within 4/3 of it")] = 5.0,
    window: Annotated[int, typer.Option(help="pending sessions per workload shown to the policy")] = 1024,
    log_level: Annotated[str, typer.Option(help="logging level")] = "INFO",
) -> None:
    """Run the broker: active while it holds the namespace's lease, standby otherwise."""
    import logging
    import signal
    import threading

    from broker.service import BrokerService, BrokerSettings, load_policy

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    service = BrokerService(redis_url, namespace, load_policy(policy),
                            BrokerSettings(lease_period_s=lease_s, window=window))
    service.run(stop)


@app.command("api")
def api(
    host: Annotated[str, typer.Option(help="address to bind; non-loopback needs --token")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8080,
    redis_url: Annotated[str, typer.Option(help="Redis server URL")] = "redis://127.0.0.1:6379/0",
    namespace: Annotated[str, typer.Option(help="key namespace (one RL job)")] = "default",
    token: Annotated[Optional[str], typer.Option(
        help="bearer token required by the mutating endpoints", envvar="RB_API_TOKEN")] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info",
) -> None:
    """Serve the status API, Prometheus metrics and the live dashboard."""
    from api.app import serve
    from api.settings import ApiSettings

    settings = ApiSettings(host=host, port=port, redis_url=redis_url, namespace=namespace,
                           token=token or None)
    try:
        serve(settings, log_level=log_level.lower())
    except ValueError as exc:
        typer.echo(f"rollout-broker api: {exc}", err=True)
        raise typer.Exit(2) from None


if __name__ == "__main__":
    app()
