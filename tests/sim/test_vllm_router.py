"""The real vLLM Router (`vllm-router` 0.1.17, policy cache_aware) in front of three sim engines.

A 10-turn chat goes through the router; each turn's prompt is the previous history plus the reply
plus a new user message. The claim under test: the router's prefix tree keeps the conversation on
the engine that served its first turn, so every later turn hits that engine's prefix cache.

On idle engines that claim is empty: the router breaks load ties by its worker order, so a
sequential conversation stays on the first worker whether or not prefixes are matched. Here the
engines carry competing load while the conversation runs. After turn 1 the test pins seven
unrelated long requests through the router (streamed, each stays in flight from dispatch until
the test closes it; at time scale 1 it would run for minutes); the router places them on the
least loaded engine, which leaves the conversation's engine the busiest: 3 in flight against 2
and 2. That is balanced for the router (max − min = 1, not > balance_abs_threshold 64), so its
cache-aware branch applies, and a router that ignored prefixes would send every later turn to a
less loaded engine. The pinned load is the same before every turn (checked on the router's own
/workers counts), so each routing decision is made on a known, fixed state: no timing races.

`test_router_without_prefix_matching_splits_the_conversation` runs the same scenario with prefix
matching off (`--cache-threshold 1.0`: no match rate exceeds 1) and shows the conversation moves,
and that the check of the first test fails on it, so the pair proves the mechanism.

The router matches token ids, which it asks a worker's /v1/chat/completions/render for, so each
turn's key extends the last one's. Where each turn ran is read from the engines' own
`vllm:request_success_total` (one request is on the move at a time); cache hits from
`cached_tokens` and `vllm:prefix_cache_hits_total`. Engines run as `rollout-broker sim-engine`
subprocesses (python -m rollout_broker.cli), so this also covers the CLI. Every process is stopped in
`finally`; tests/sim/test_router_differential.py reuses the helpers here.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker.binaries import find_executable

ROOT = Path(__file__).resolve().parents[2]
PROFILE, MODEL = "h100-8b", "sim-llama3-8b"
STARTUP_TIMEOUT_S = 60.0
SETTLE_TIMEOUT_S = 10.0  # for the router's in-flight counts to show a dispatch or a completion
# Engine seconds per wall second. At 1 a pinned request (PIN_TOKENS decode steps of ≥ 6 ms each)
# would run for minutes; a chat turn takes a fraction of a second.
TIME_SCALE = 1.0
PIN_TOKENS = 30_000

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
    """Processes started inside are terminated on exit, killed if not gone within 5 s in all."""
    procs: list[subprocess.Popen] = []
    try:
        yield procs
    finally:
        for p in reversed(procs):  # the router (started last) first: it holds the engines' sockets
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 5.0
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


def start_engine(procs: list[subprocess.Popen], seed: int, time_scale: float = TIME_SCALE) -> str:
    port = free_port()
    cmd = [sys.executable, "-m", "rollout_broker.cli", "sim-engine", "--port", str(port), "--profile",
           PROFILE, "--time-scale", str(time_scale), "--seed", str(seed)]
    procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)}))
    url = f"http://127.0.0.1:{port}"
    wait_ready(url + "/health", procs[-1], f"sim engine on {port}")
    return url


def start_router(procs: list[subprocess.Popen], workers: list[str], *extra: str) -> str:
    """vllm-router with policy cache_aware; `extra` adds flags (e.g. --cache-threshold 1.0)."""
    router = find_executable("vllm-router")
    assert router is not None, "vllm-router is not installed (pip install vllm-router==0.1.17)"
    port = free_port()
    cmd = [router, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
           "--policy", "cache_aware", "--worker-startup-check-interval", "1",
           "--worker-startup-timeout-secs", str(int(STARTUP_TIMEOUT_S)),
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           "--log-level", "warning", *extra]
    procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    url = f"http://127.0.0.1:{port}"
    wait_ready(url + "/health", procs[-1], "vllm-router")
    return url


def engine_counters(url: str) -> dict[str, float]:
    """An engine's counters; "completed" is request_success_total less aborted requests."""
    text = httpx.get(url + "/metrics", timeout=5).text
    wanted = {"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
              "vllm:request_success_total"}
    out = dict.fromkeys([*wanted, "completed"], 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in wanted:
                out[s.name] += s.value
            if s.name == "vllm:request_success_total" and s.labels["finished_reason"] != "abort":
                out["completed"] += s.value
    return out


def router_loads(router: str) -> dict[str, int]:
    """The router's own load per worker (requests dispatched, not yet finished), in its order.

    The order is the router's worker list, the one its least-loaded scan breaks ties by.
    """
    workers = httpx.get(router + "/workers", timeout=5).json()["workers"]
    return {w["url"]: int(w["load"]) for w in workers}


class RouterRig:
    """Sends requests through a router one at a time and learns where each one ran.

    `pin` starts a long streamed request and returns once the router has dispatched it, with the
    engine it chose (the one whose router load went up); it stays in flight until `unpin` or
    `close` drops it (the router then cancels it on the engine).
    `run` sends a request, waits for the answer, and returns the engine that served it (the one
    whose `vllm:request_success_total`, aborts aside, moved: nothing else completes meanwhile)
    once the router counts it finished. Between calls the router's loads are known exactly.
    """

    def __init__(self, router: str, engines: list[str]) -> None:
        self.router, self.engines = router, engines
        self.client = httpx.Client(timeout=60)
        self._pins: dict[int, tuple[httpx.Response, str]] = {}  # by pin number, in pin order
        self._pinned = 0

    def loads(self) -> dict[str, int]:
        return router_loads(self.router)

    def _settle(self, want: dict[str, int]) -> None:
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while (now := self.loads()) != want:
            if time.monotonic() > deadline:
                raise TimeoutError(f"router loads {now}, expected {want}")
            time.sleep(0.01)

    def pin(self, path: str, body: dict[str, Any]) -> str:
        before = self.loads()
        request = self.client.build_request(
            "POST", self.router + path,
            json={**body, "model": MODEL, "max_tokens": PIN_TOKENS, "sim_output_len": PIN_TOKENS,
                  "stream": True})
        response = self.client.send(request, stream=True)
        response.raise_for_status()
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while (after := self.loads()) == before:
            if time.monotonic() > deadline:
                raise TimeoutError(f"router loads stayed {before} after a pinned request")
            time.sleep(0.01)
        moved = [url for url in after if after[url] != before[url]]
        assert len(moved) == 1 and after[moved[0]] == before[moved[0]] + 1, (before, after)
        self._pins[self._pinned] = (response, moved[0])
        self._pinned += 1
        return moved[0]

    @property
    def open_pins(self) -> list[int]:
        return sorted(self._pins)

    def unpin(self, number: int) -> str:
        """Drop pin `number` (0 for the first `pin`); returns the engine it was on."""
        response, engine = self._pins.pop(number)
        want = self.loads()
        want[engine] -= 1
        response.close()
        self._settle(want)
        return engine

    def run(self, path: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        before_loads = self.loads()
        before = {e: engine_counters(e)["completed"] for e in self.engines}
        response = self.client.post(self.router + path, json={**body, "model": MODEL})
        response.raise_for_status()
        after = {e: engine_counters(e)["completed"] for e in self.engines}
        served = [e for e in self.engines if after[e] != before[e]]
        assert len(served) == 1 and after[served[0]] == before[served[0]] + 1, (before, after)
        self._settle(before_loads)
        return served[0], response.json()

    def close(self) -> None:
        for response, _ in self._pins.values():
            response.close()  # the router drops the stream and the engine aborts the request
        self._pins.clear()
        self.client.close()


SYSTEM = ("You are a careful assistant for a long-running agent. Keep the whole history in mind, "
          "answer each question briefly, and refer back to earlier turns when useful. ") * 8
TURNS = 10
PINS = 7  # on three engines placed least-loaded first: 3 on the conversation's engine, 2 and 2


@dataclass
class Conversation:
    order: list[str]  # the router's worker order
    engines: list[str]  # where each turn ran
    cached: list[int]  # each turn's cached_tokens
    loads: list[dict[str, int]]  # the router's loads just before each turn
    hits_after: list[float]  # prefix-cache hits over all engines after each turn


def run_conversation(*router_flags: str) -> Conversation:
    with processes() as procs:
        engines = [start_engine(procs, seed) for seed in (1, 2, 3)]
        router = start_router(procs, engines, *router_flags)
        rig = RouterRig(router, engines)
        try:
            order = list(rig.loads())
            messages = [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "turn 1: what is a rollout?"}]
            out = Conversation(order=order, engines=[], cached=[], loads=[], hits_after=[])
            for turn in range(1, TURNS + 1):
                if turn == 2:  # the competing load, unrelated to the conversation's prefix
                    for i in range(PINS):
                        rig.pin("/v1/completions",
                                {"prompt": f"competing rollout {i}: " + "tool output " * 40})
                out.loads.append(rig.loads())
                engine, resp = rig.run("/v1/chat/completions",
                                       {"messages": messages, "max_tokens": 48,
                                        "sim_output_len": 24})
                assert resp["usage"]["completion_tokens"] == 24
                out.engines.append(engine)
                out.cached.append(resp["usage"]["prompt_tokens_details"]["cached_tokens"])
                out.hits_after.append(sum(engine_counters(e)["vllm:prefix_cache_hits_total"]
                                          for e in engines))
                messages += [{"role": "assistant",
                              "content": resp["choices"][0]["message"]["content"]},
                             {"role": "user", "content": f"turn {turn + 1}: and then?"}]
            assert rig.loads() == out.loads[-1]  # the pinned requests were in flight throughout
            return out
        finally:
            rig.close()


def check_competing_load(conv: Conversation) -> None:
    """Turn 1 ran on an idle fleet; every later turn saw its engine busiest but balanced."""
    home = conv.engines[0]
    assert conv.loads[0] == dict.fromkeys(conv.order, 0)
    assert home == conv.order[0], "an idle router breaks the tie by its worker order"
    pinned = conv.loads[1]
    assert all(load == pinned for load in conv.loads[1:]), conv.loads
    assert pinned[home] == max(pinned.values()) > min(pinned.values()), pinned
    # Balanced: max − min ≤ balance_abs_threshold (64), so the cache-aware branch decides.
    assert max(pinned.values()) - min(pinned.values()) <= 64, pinned


def assert_kept_together(conv: Conversation) -> None:
    """What cache-aware routing promises: one engine for the whole conversation."""
    assert len(set(conv.engines)) == 1, (
        "cache-aware routing should keep the conversation on one engine; its turns ran on "
        f"workers {[conv.order.index(e) for e in conv.engines]} (in the router's order), "
        f"which had {[conv.loads[-1][u] for u in conv.order]} other requests in flight")


def test_router_cache_aware_keeps_conversation_on_its_busiest_engine() -> None:
    conv = run_conversation()  # the router's defaults: cache_threshold 0.3
    check_competing_load(conv)
    assert_kept_together(conv)
    assert conv.hits_after[0] == 0 and conv.cached[0] == 0  # fresh engines: nothing to hit
    assert all(c > 0 for c in conv.cached[1:]), conv.cached  # every follow-up turn hits
    assert all(later > earlier for earlier, later in zip(conv.hits_after, conv.hits_after[1:]))
    assert conv.hits_after[-1] == sum(conv.cached)  # the engines' counters agree


def test_router_without_prefix_matching_splits_the_conversation() -> None:
    conv = run_conversation("--cache-threshold", "1.0")  # no match rate exceeds 1.0
    check_competing_load(conv)
    # Least-loaded routing alone: turn 1 on the idle fleet's first worker, every later turn on
    # the least loaded engine, the first of the two with 2 in flight.
    pinned = conv.loads[1]
    least = min(conv.order, key=pinned.__getitem__)
    assert conv.engines == [conv.order[0]] + [least] * (TURNS - 1), conv.engines
    assert conv.cached[1] == 0  # the move cost the conversation its cache
    with pytest.raises(AssertionError, match="should keep the conversation on one engine"):
        assert_kept_together(conv)
