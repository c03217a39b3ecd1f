"""The whole path on real vLLM: trainer client -> Redis -> broker -> worker -> vLLM (CPU build,
tiny model) and back, each test in its own namespace on the shared engine.

Covered: every workload kind with logprobs (agentic turns through a real text tool, their
histories hitting vLLM's prefix cache), the vocabulary at enqueue, cancel, the three pause
modes with the exact policy version of every span, and the shipped weights hook swapping real
weights. Exactly-once is checked against the engine's own counter of generated tokens.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from broker.client import RolloutClient
from broker.policies import make_policy
from broker.policies.misa_t import MisaT, MisaTConfig
from broker.policies.misa_t_control import AimdParams
from broker.session import SamplingParams, Session, SessionState
from tests.broker.helpers import BrokerThread, wait_until
from tests.vllm.conftest import VOCAB, RealEngine, TinyModels
from tests.workers.helpers import WorkerThread, generation_tokens
from workers.tools import load_registry

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.redis,
              pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def fleet(redis_url: str, namespace: str, engine: RealEngine, **worker):
    """A broker (least_loaded) and one worker on `engine`; yields the trainer's client."""
    w = WorkerThread(redis_url, namespace, "v0", engine.url, time_scale=1.0, **worker).start()
    broker = BrokerThread(redis_url, namespace, make_policy("least_loaded")).start()
    client = RolloutClient(redis_url, namespace)
    try:
        assert wait_until(lambda: client.status()["backends"].get("v0", {}).get("healthy"),
                          timeout=60)
        yield client
    finally:
        broker.stop()
        w.stop()
        client.close()


def collect(client: RolloutClient, n: int, timeout: float = 180) -> list:
    got: list = []
    assert wait_until(lambda: len(got.__iadd__(client.results(n, timeout=0.5)) or got) >= n,
                      timeout=timeout, every=0), f"{len(got)} of {n} results"
    client.ack()
    return got


def ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % (VOCAB - 3) + 3 for i in range(n)]


def engine_running(engine: RealEngine) -> int:
    text = httpx.get(f"{engine.url}/metrics").text
    return sum(int(float(line.split()[-1])) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running{"))


def test_every_workload_runs_with_logprobs_and_agentic_histories_hit_the_prefix_cache(
        redis_url, namespace, vllm_engine: RealEngine):
    """GRPO group, RLHF pair, agentic episodes through the calculator tool (a real text tool:
    turn text from the engine, its observation text tokenized by the engine)."""
    registry = load_registry(str(ROOT / "examples" / "arith_tools.toml"))
    sessions = [Session(session_id=f"g-{i}", workload="rlvr", group_id="g", group_size=4,
                        prompt_token_ids=ids(1, 60), max_tokens=48,
                        sampling=SamplingParams(seed=i)) for i in range(4)]
    sessions += [Session(session_id=f"h-{i}", workload="rlhf", prompt_token_ids=ids(2 + i, 80),
                         max_tokens=32, metadata={"reward": "parity"}) for i in range(2)]
    sessions += [Session(session_id=f"a-{i}", workload="agentic", prompt_token_ids=ids(5 + i, 100),
                         max_tokens=40, max_turns=3,
                         metadata={"tool": "calculator", "reward": "arith", "answer": 7})
                 for i in range(2)]
    with fleet(redis_url, namespace, vllm_engine, registry=registry) as client:
        before = generation_tokens(vllm_engine.url)
        client.enqueue(sessions)
        got = collect(client, len(sessions))
        generated = generation_tokens(vllm_engine.url) - before
    assert sorted(r.session_id for r in got) == sorted(s.session_id for s in sessions)
    assert [(r.session_id, r.error) for r in got if r.status != SessionState.done] == []
    assert sum(r.output_tokens for r in got) == generated  # each token published once
    for r in got:
        for t in r.turn_records:
            assert len(t.output_logprobs) == len(t.output_token_ids) > 0
            assert all(v <= 0.0 for v in t.output_logprobs)
        traj = r.trajectory()
        assert traj.loss_mask.count(1) == r.output_tokens
    agentic = [r for r in got if r.workload == "agentic"]
    for r in agentic:
        assert r.turns >= 2 and r.reward in (0.0, 1.0)
        assert all(t.input_token_ids for t in r.turn_records)  # observations, tokenized
        # Finding 4: turn 2's prompt is turn 1's history: vLLM's prefix cache served it.
        assert r.cached_tokens >= 96
    group = [r for r in got if r.group_id == "g"]
    assert len({tuple(r.turn_records[0].output_token_ids) for r in group}) == 4  # 4 seeds


def test_a_prompt_outside_the_engines_vocabulary_is_refused_at_enqueue(
        redis_url, namespace, vllm_engine: RealEngine):
    """Finding 3: before, the worker could not learn the vocabulary of a real engine, so such
    a prompt passed enqueue and failed at the engine after admission."""
    with fleet(redis_url, namespace, vllm_engine) as client:
        bad = Session(session_id="oov", workload="rlhf", prompt_token_ids=[5, VOCAB], max_tokens=4)
        with pytest.raises(ValueError, match=f"token id {VOCAB} is not below the served "
                                             f"vocabulary size {VOCAB}"):
            client.enqueue([bad])
        client.enqueue([bad.model_copy(update={"prompt_token_ids": [5, VOCAB - 1]})])
        got = collect(client, 1)
    assert got[0].status == SessionState.done


def long_sessions(n: int, tag: str, max_tokens: int = 1200, **extra) -> list[Session]:
    return [Session(session_id=f"{tag}-{i}", workload="rlvr", prompt_token_ids=ids(10 + i, 50),
                    max_tokens=max_tokens, sampling=SamplingParams(ignore_eos=True), **extra)
            for i in range(n)]


def test_cancelling_a_running_session_stops_its_request_in_vllm(
        redis_url, namespace, vllm_engine: RealEngine):
    with fleet(redis_url, namespace, vllm_engine) as client:
        client.enqueue(long_sessions(2, "c", max_tokens=1900))
        assert wait_until(lambda: engine_running(vllm_engine) == 2, timeout=60)
        assert client.cancel("c-0") == "cancelled"
        t0 = time.monotonic()
        assert wait_until(lambda: engine_running(vllm_engine) == 1, timeout=5, every=0.01)
        stopped_s = time.monotonic() - t0
        got = collect(client, 1)
    assert [r.session_id for r in got] == ["c-1"] and stopped_s < 1.0


def test_pauses_keep_and_abort_give_every_span_its_exact_policy_version(
        redis_url, namespace, vllm_engine: RealEngine):
    """Finding 5: after a keep pause, tokens generated after resume(v+1) were recorded under v
    in one record. The engine labels its weights (/update_weight_version) and says which label
    made which tokens; tokens counted by the engine at each pause are the tokens of the old
    version, to the token."""
    n = 4

    def settled() -> int:  # the engine's count once its last outputs are out
        counted = generation_tokens(vllm_engine.url) - base
        time.sleep(0.3)
        assert generation_tokens(vllm_engine.url) - base == counted  # paused: frozen
        return counted

    with fleet(redis_url, namespace, vllm_engine) as client:
        base = generation_tokens(vllm_engine.url)
        client.enqueue(long_sessions(n, "k"))
        assert wait_until(lambda: engine_running(vllm_engine) == n, timeout=60)
        time.sleep(0.5)
        client.pause("keep")
        at_keep = settled()
        client.resume(1)
        time.sleep(0.5)
        client.pause("abort")
        at_abort = settled()
        client.resume(2)
        got = collect(client, n)
        generated = generation_tokens(vllm_engine.url) - base
    tokens = {0: 0, 1: 0, 2: 0}
    for r in got:
        assert r.status == SessionState.done and r.output_tokens == 1200
        # keep split one request where the weights changed; abort cut it, and it went on
        assert [t.policy_version for t in r.turn_records] == [0, 1, 2]
        assert [t.finish_reason for t in r.turn_records] == [None, "abort", "length"]
        assert [t.turn for t in r.turn_records] == [0, 0, 0]
        for t in r.turn_records:
            tokens[t.policy_version] += len(t.output_token_ids)
            assert len(t.output_logprobs) == len(t.output_token_ids)
    assert generated == n * 1200  # the abort pause cut requests; nothing was generated twice
    assert tokens[0] == at_keep > 0
    assert tokens[1] == at_abort - at_keep > 0
    assert tokens[2] == generated - at_abort > 0


def test_pause_wait_lets_requests_finish_on_the_old_version(
        redis_url, namespace, vllm_engine: RealEngine):
    with fleet(redis_url, namespace, vllm_engine) as client:
        client.enqueue(long_sessions(2, "w", max_tokens=300))
        assert wait_until(lambda: engine_running(vllm_engine) == 2, timeout=60)
        client.pause("wait")
        assert engine_running(vllm_engine) == 0  # the pause returned once they finished
        got = collect(client, 2, timeout=30)
        assert httpx.get(f"{vllm_engine.url}/is_paused").json()["is_paused"]
        client.resume(5)
        client.enqueue(long_sessions(1, "after", max_tokens=20))
        got += collect(client, 1)
    versions = {r.session_id: [t.policy_version for t in r.turn_records] for r in got}
    assert versions == {"w-0": [0], "w-1": [0], "after-0": [5]}


def test_the_shipped_weights_hook_swaps_real_weights_on_resume(
        redis_url, namespace, vllm_engine: RealEngine, tiny_models: TinyModels, tmp_path,
        monkeypatch):
    """Finding 7: workers.vllm_weights:reload_checkpoint loads version v's checkpoint through
    vLLM's /collective_rpc reload_weights. Greedy outputs change with the weights of another
    checkpoint, and come back with the first one's."""
    from workers.vllm_weights import reload_checkpoint

    (tmp_path / "step-1").symlink_to(tiny_models.seed1)
    (tmp_path / "step-2").symlink_to(tiny_models.seed0)
    monkeypatch.setenv("RB_WEIGHTS_PATH", str(tmp_path / "step-{version}"))

    def greedy(tag: str) -> Session:
        return Session(session_id=tag, workload="rlhf", prompt_token_ids=ids(3, 40),
                       max_tokens=16, sampling=SamplingParams(temperature=0.0, ignore_eos=True))

    outputs = {}
    with fleet(redis_url, namespace, vllm_engine, weights_hook=reload_checkpoint) as client:
        for version in (None, 1, 2):
            if version is not None:
                client.pause("abort")
                client.resume(version)
            client.enqueue([greedy(f"v{version}")])
            r, = collect(client, 1)
            assert r.status == SessionState.done, r.error
            assert r.turn_records[0].policy_version == (version or 0)
            outputs[version] = r.turn_records[0].output_token_ids
    assert outputs[1] != outputs[None]  # other weights, other greedy tokens
    assert outputs[2] == outputs[None]  # the first checkpoint again


@dataclass(frozen=True)
class RecordingAimd(AimdParams):
    """MISA-T's α control as shipped, recording each heartbeat it steps on."""

    steps: list = field(default_factory=list)  # (preemptions before, now, α in, α out, R/C)

    def step(self, alpha, now, before, **kwargs):
        out = AimdParams.step(self, alpha, now, before, **kwargs)
        self.steps.append((before.preemptions_total if before else None,
                           now.preemptions_total, alpha, out,
                           kwargs["reserved"] / kwargs["capacity"]))
        return out


def test_preemptions_in_vllm_reach_misa_ts_feedback(redis_url, namespace, vllm_engine: RealEngine):
    """More work than the engine's 8,192 KV tokens (sessions the broker admitted, and requests
    of another tenant sent straight to the engine) makes vLLM preempt; the count reaches
    MISA-T through the worker's heartbeat, and on that heartbeat it backs the backend's α off
    by its preemption factor."""
    import threading

    aimd = RecordingAimd()
    policy = MisaT(MisaTConfig(aimd=aimd))
    w = WorkerThread(redis_url, namespace, "v0", vllm_engine.url, time_scale=1.0).start()
    # (a lease the busy 2-core box cannot make the broker miss)
    broker = BrokerThread(redis_url, namespace, policy, lease_s=10.0).start()
    client = RolloutClient(redis_url, namespace)
    stop = threading.Event()

    def tenant(i: int) -> None:  # no worker, no broker: KV the ledger does not know about
        with httpx.Client(timeout=300) as http:
            while not stop.is_set():
                try:
                    http.post(f"{vllm_engine.url}/inference/v1/generate", json={
                        "token_ids": ids(100 + i, 200),
                        "sampling_params": {"max_tokens": 1200, "ignore_eos": True}},
                        timeout=httpx.Timeout(300, read=2.0))
                except httpx.ReadTimeout:
                    pass  # gone (the engine aborts it) once stopped; else sent again

    tenants = [threading.Thread(target=tenant, args=(i,)) for i in range(6)]

    def backed_off(b, now, a, out, charged) -> bool:
        expected = max(aimd.alpha_min, a * aimd.backoff_preempt,
                       min(a, aimd.backoff_preempt * charged))
        # (a beat where the ledger charged more than α·C holds α: it shows nothing)
        return (b is not None and now > b and (expected < a or a == aimd.alpha_min)
                and out == pytest.approx(expected))

    def backed_off_on_a_preemption() -> bool:
        return any(backed_off(*step) for step in list(aimd.steps))

    try:
        assert wait_until(lambda: client.status()["backends"].get("v0", {}).get("healthy"),
                          timeout=60)
        # A multi-turn workload in the mixture keeps MISA-T's admission closed (α binds).
        client.set_mixture({"rlvr": 0.5, "agentic": 0.5})
        before = engine_preemptions(vllm_engine)
        client.enqueue(long_sessions(16, "m", max_tokens=800))  # twice what fits: MISA-T runs
        for t in tenants:
            t.start()
        assert wait_until(lambda: engine_preemptions(vllm_engine) > before, timeout=120)
        assert wait_until(backed_off_on_a_preemption, timeout=30), aimd.steps[-5:]
        assert max(now for _, now, *_ in aimd.steps) > before
    finally:
        stop.set()
        for t in tenants:
            if t.is_alive():
                t.join(timeout=30)
        broker.stop()
        w.stop()
        client.close()


def engine_preemptions(engine: RealEngine) -> int:
    """vLLM's own counter, read off its /metrics text (not through the worker's parser)."""
    text = httpx.get(f"{engine.url}/metrics").text
    return sum(int(float(line.split()[-1])) for line in text.splitlines()
               if line.startswith("vllm:num_preemptions_total{"))
