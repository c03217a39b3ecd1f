"""Ordinary mistakes on the command line: one line naming the option, exit status 2, and nothing
started (no engine, no Redis server, no child process, no connection)."""

from __future__ import annotations

import subprocess

import pytest
import redis
from typer.testing import CliRunner

from rollout_broker.cli import app


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fail the test if the command starts a process or opens a Redis connection."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"started something: {args[:1]}")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(redis.Redis, "execute_command", refuse)


MISTAKES = [
    (["broker", "--policy", "nope"], "policy: unknown policy 'nope'"),
    (["broker", "--policy", "misa_t-true-lengths"], "policy: 'misa_t-true-lengths' runs only in the simulator"),
    (["broker", "--policy", "no_such_module:factory"], "policy: cannot load 'no_such_module:factory'"),
    (["broker", "--redis-url", "foo://x"], "redis_url: 'foo://x'"),
    (["broker", "--lease-s", "0"], "lease_s: 0 must be more than 0"),
    (["worker", "--backend-id", "w", "--engine", "bogus:x"], "engine: 'bogus:x' must be"),
    (["worker", "--backend-id", "w", "--engine", "sim:nope"], "engine: sim: profile: unknown engine profile 'nope'"),
    (["worker", "--backend-id", "w", "--engine", "attach:localhost:8000"], "must name an http:// or https:// URL"),
    (["worker", "--backend-id", "w", "--engine", "sim:h100-8b", "--redis-url", "redis://h:x/0"],
     "redis_url: 'redis://h:x/0'"),
    (["worker", "--backend-id", "w", "--engine", "sim:h100-8b", "--time-scale", "0"],
     "time_scale: 0 must be more than 0"),
    (["worker", "--backend-id", "w", "--engine", "sim:h100-8b", "--tools", "celery"],
     "tools: 'celery' must be 'inline' or 'rq'"),
    (["worker", "--backend-id", "w", "--engine", "sim:h100-8b", "--weights-hook", "no_such_module:load"],
     "weights-hook: cannot import 'no_such_module:load'"),
    (["worker", "--backend-id", "w", "--engine", "sim:h100-8b", "--weights-hook", "load_weights"],
     "weights-hook: 'load_weights' must be 'package.module:function'"),
    (["worker", "--backend-id", "w", "--engine", "sim:h100-8b", "--engine-host", "0.0.0.0"],
     "advertise_url: an engine bound to 0.0.0.0 is for a session gateway elsewhere"),
    (["worker", "--backend-id", "w", "--engine", "attach:http://e:8000", "--engine-port", "9"],
     "engine_host: an attached engine listens where it was started"),
    (["gateway", "--host", "0.0.0.0"], "token: binding 0.0.0.0 (not loopback) needs --token"),
    (["gateway", "--redis-url", "foo://x"], "redis_url: 'foo://x'"),
    (["gateway", "--admission-timeout", "0"], "admission_timeout: must be a positive number"),
    (["gateway", "--tokenizer", "/no/such/tokenizer"], "tokenizer: cannot load '/no/such/tokenizer'"),
    (["sim-engine", "--journal", "-1"], "journal: must be 0 or more requests"),
    (["demo", "--scenario", "/no/such.yaml"], "such.yaml: cannot read"),
    (["demo", "--duration", "-5"], "duration: -5 must be more than 0 seconds"),
    (["demo", "--engines", "0"], "engines: 0 must be at least 1"),
    (["demo", "--policy", "nope"], "policy: unknown policy 'nope'"),
    (["demo", "--kv-tokens", "0"], "kv_tokens: 0 must be at least 1"),
    (["demo", "--tools", "celery"], "tools: 'celery' must be 'inline' or 'rq'"),
    (["demo", "--redis-url", "http://localhost:6379"], "redis_url: 'http://localhost:6379'"),
    (["sim-engine", "--profile", "nope"], "profile: unknown engine profile 'nope'"),
    (["sim-engine", "--kv-tokens", "0"], "kv_tokens: 0 must be at least 1"),
    (["bench", "--scenario", "scenarios/quick.yaml", "--jobs", "0"], "jobs: 0 must be at least 1"),
    (["api", "--redis-url", "foo://x"], "redis_url: 'foo://x'"),
    (["list", "engines"], "what: 'engines' must be 'policies' or 'profiles'"),
]


@pytest.mark.parametrize(("argv", "message"), MISTAKES, ids=[" ".join(a) for a, _ in MISTAKES])
def test_a_mistake_is_one_line_exit_2_and_starts_nothing(argv, message, nothing_starts) -> None:
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1, res.output
    assert lines[0].startswith(f"rollout-broker {argv[0]}: ") and message in lines[0], lines[0]


def test_version_and_lists(nothing_starts) -> None:
    from importlib.metadata import version

    res = CliRunner().invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.strip() == f"rollout-broker {version('rollout-broker')}"
    res = CliRunner().invoke(app, ["list", "policies"])
    assert res.exit_code == 0
    assert "misa_t (default)" in res.output.splitlines()
    assert "misa_t-true-lengths (simulator only: rollout-broker bench)" in res.output.splitlines()
    res = CliRunner().invoke(app, ["list", "profiles"])
    assert res.exit_code == 0 and res.output.startswith("h100-8b: ")


def test_the_engine_option_shows_its_forms_in_the_help() -> None:
    res = CliRunner().invoke(app, ["worker", "--help"], terminal_width=200)
    assert "vllm:MODEL ARGS..." in " ".join(res.output.split())


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["broker"], {"RB_REDIS_URL": "foo://x"}, "redis_url: 'foo://x'"),
    (["broker"], {"RB_POLICY": "nope"}, "policy: unknown policy 'nope'"),
    (["worker", "--backend-id", "w"], {"RB_ENGINE": "sim:nope"}, "engine: sim: profile"),
    (["worker", "--engine", "sim:h100-8b"], {"RB_BACKEND_ID": "w", "RB_REDIS_URL": "foo://y"},
     "redis_url: 'foo://y'"),
    (["demo"], {"RB_REDIS_URL": "http://x"}, "redis_url: 'http://x'"),
    (["api"], {"RB_API_HOST": "0.0.0.0", "RB_API_TOKEN": ""}, "token"),
    (["tools"], {"RB_NAMESPACE": "a:b"}, "namespace"),
])
def test_every_command_reads_its_options_from_rb_variables(argv, env, message, nothing_starts):
    res = CliRunner().invoke(app, argv, env=env)
    assert res.exit_code == 2, res.output
    assert message in res.output.strip().splitlines()[0], res.output


def test_the_command_list_gives_each_command_one_unbroken_summary():
    """A docstring's line breaks do not cut a summary: on a wide terminal each is one line."""
    result = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "250", "TERMINAL_WIDTH": "250"})
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if "Health probe" in x)
    assert "an RQ worker on this host beats)." in line, result.output
