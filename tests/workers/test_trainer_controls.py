"""A trainer's controls while rollouts run: broker + two workers on simulated engines, real Redis.

Weight updates: pause(abort) cuts requests short and the sessions go on from what they had on
the new version; pause(keep) freezes them in the engines; nothing is admitted while paused, no
session is lost, and every span says which policy version generated it. Cancel: a running
session's engine request is gone at once and nothing of it is published.
"""

from __future__ import annotations

import time

import httpx
import pytest

from broker.client import RolloutClient
from broker.policies import make_policy
from broker.session import Session, SessionState
from sim.server.testing import running_engine
from tests.broker.helpers import BrokerThread, collect, wait_until
from tests.workers.helpers import WorkerThread, generation_tokens, prompt

pytestmark = pytest.mark.timeout(120)

OUTPUT = 1500  # tokens per session (the simulated truth): long enough to be cut by a pause


def long_sessions(n: int, tag: str) -> list[Session]:
    return [Session(session_id=f"{tag}-{i}", workload="rlvr", prompt_token_ids=prompt(i, 100),
                    max_tokens=4000, metadata={"sim_output_tokens": str(OUTPUT)})
            for i in range(n)]


def engines_running(urls: list[str]) -> int:
    total = 0
    for url in urls:
        text = httpx.get(f"{url}/metrics").text
        line = next(x for x in text.splitlines() if x.startswith("vllm:num_requests_running"))
        total += int(float(line.split()[-1]))
    return total


def run_fleet(redis_url: str, namespace: str, scenario) -> tuple[list, dict[str, int]]:
    with running_engine(time_scale=10.0, kv_tokens=200_000) as e0, \
            running_engine(time_scale=10.0, kv_tokens=200_000) as e1:
        engines = {"w0": e0.url, "w1": e1.url}
        workers = [WorkerThread(redis_url, namespace, b, url, time_scale=10.0).start()
                   for b, url in engines.items()]
        broker = BrokerThread(redis_url, namespace, make_policy("least_loaded")).start()
        client = RolloutClient(redis_url, namespace)
        try:
            assert wait_until(lambda: all(client.status()["backends"].get(b, {}).get("healthy")
                                          for b in engines), timeout=30)
            got = scenario(client, list(engines.values()))
        finally:
            broker.stop()
            for w in workers:
                w.stop()
            client.close()
        return got, {b: generation_tokens(url) for b, url in engines.items()}


def test_pause_abort_keeps_partial_outputs_and_resumes_them_on_the_new_version(redis_url,
                                                                              namespace,
                                                                              redis_client):
    def admitted_at(sid: str) -> float:
        return float(redis_client.hget(f"rb:{{{namespace}}}:session:{sid}", "admitted_at"))

    def scenario(client: RolloutClient, urls: list[str]) -> list:
        client.enqueue(long_sessions(12, "a"))
        assert wait_until(lambda: engines_running(urls) >= 4, timeout=30)
        paused = client.pause("abort")
        assert sorted(paused) == ["w0", "w1"]
        assert all(httpx.get(f"{u}/is_paused").json()["is_paused"] for u in urls)
        assert client.weights().paused == "abort"
        before = sum(generation_tokens(u) for u in urls)
        client.enqueue(long_sessions(4, "late"))  # enqueued while paused
        time.sleep(0.3)
        assert sum(generation_tokens(u) for u in urls) == before  # nothing generates
        resumed_at = time.time()
        client.resume(1)
        got = collect(client, 16)
        late = [r for r in got if r.session_id.startswith("late")]
        assert len(late) == 4
        assert all(admitted_at(r.session_id) >= resumed_at for r in late), "admitted while paused"
        return got

    got, generated = run_fleet(redis_url, namespace, scenario)
    assert sorted(r.status for r in got) == [SessionState.done] * 16
    for r in got:
        # Every session has its whole output, and the engines generated each token once:
        # what a pause cut short was kept, not generated again.
        assert r.output_tokens == OUTPUT == sum(len(t.output_token_ids) for t in r.turn_records)
        assert r.trajectory().loss_mask.count(1) == OUTPUT
    assert sum(generated.values()) == 16 * OUTPUT
    cut = [r for r in got if len(r.turn_records) == 2]
    assert cut, "no session was running when the pause aborted its request"
    for r in cut:
        first, second = r.turn_records
        assert (first.turn, second.turn) == (0, 0)
        assert (first.policy_version, second.policy_version) == (0, 1)
        assert first.finish_reason == "abort" and second.input_token_ids == []
        assert len(first.output_logprobs) == len(first.output_token_ids) > 0
    for r in got:
        if r.session_id.startswith("late"):
            assert [t.policy_version for t in r.turn_records] == [1]


def test_pause_keep_freezes_sessions_and_loses_none(redis_url, namespace):
    """A request frozen across the update is split where the engine's weights label changed:
    every token generated before the pause carries version 0, every one after the resume 3."""
    frozen = {}

    def scenario(client: RolloutClient, urls: list[str]) -> list:
        client.enqueue(long_sessions(8, "k"))
        assert wait_until(lambda: engines_running(urls) >= 2, timeout=30)
        client.pause("keep")
        assert client.pause("keep") == ["w0", "w1"]  # a second pause changes nothing
        frozen["tokens"] = sum(generation_tokens(u) for u in urls)
        time.sleep(0.3)
        assert sum(generation_tokens(u) for u in urls) == frozen["tokens"]
        client.resume(3)
        client.enqueue(long_sessions(2, "after"))
        return collect(client, 10)

    got, generated = run_fleet(redis_url, namespace, scenario)
    assert sorted(r.status for r in got) == [SessionState.done] * 10
    assert all(r.output_tokens == OUTPUT for r in got)
    assert sum(generated.values()) == 10 * OUTPUT
    by_version = {0: 0, 3: 0}
    for r in got:
        assert [t.turn for t in r.turn_records] == [0] * len(r.turn_records)
        assert [t.policy_version for t in r.turn_records] in ([0, 3], [3])
        assert r.turn_records[-1].finish_reason == "stop"  # its simulated EOS
        if len(r.turn_records) == 2:  # frozen mid-turn: one request, two spans of versions
            first, second = r.turn_records
            assert first.finish_reason is None and second.input_token_ids == []
            assert len(first.output_logprobs) == len(first.output_token_ids) > 0
        for t in r.turn_records:
            by_version[t.policy_version] += len(t.output_token_ids)
    assert all(len(r.turn_records) == 1 for r in got if r.session_id.startswith("after"))
    assert 0 < by_version[0] == frozen["tokens"]  # the engines' counters at the pause
    assert by_version[3] == 10 * OUTPUT - frozen["tokens"]


def test_pause_with_an_unknown_mode_is_refused_naming_the_field(redis_url, namespace):
    with RolloutClient(redis_url, namespace) as client:
        with pytest.raises(ValueError, match="mode: must be one of abort, wait, keep"):
            client.pause("sleep")
        with pytest.raises(ValueError, match="version: must be a non-negative integer"):
            client.resume(-1)
        assert client.weights().paused == ""


def test_cancelling_a_running_session_stops_its_request_on_the_engine(redis_url, namespace):
    def running_ids(urls: list[str]) -> int:
        return engines_running(urls)

    def scenario(client: RolloutClient, urls: list[str]) -> list:
        sessions = long_sessions(2, "c")
        client.enqueue(sessions)
        assert wait_until(lambda: running_ids(urls) == 2, timeout=30)
        assert client.cancel("c-0") == "cancelled"
        t0 = time.monotonic()
        assert wait_until(lambda: running_ids(urls) == 1, timeout=5, every=0.01)
        stopped_s = time.monotonic() - t0
        got = collect(client, 1)
        time.sleep(0.5)  # a result of the cancelled one would have arrived by now
        got += client.results(1, timeout=0.2)
        return [stopped_s, got]

    (stopped_s, got), generated = run_fleet(redis_url, namespace, scenario)
    assert stopped_s < 1.0
    assert [r.session_id for r in got] == ["c-1"]
    assert sum(generated.values()) < 2 * OUTPUT  # c-0 stopped short of its output


def test_oversampled_groups_are_filtered_whole_and_the_surplus_is_stopped(redis_url, namespace,
                                                                          redis_client):
    def done(sid: str) -> bool:
        return redis_client.hget(f"rb:{{{namespace}}}:session:{sid}", "state") == b"done"

    def groups(g: int, output: int) -> list[Session]:
        return [Session(session_id=f"g{g}-{m}", workload="rlvr", group_id=f"g{g}", group_size=4,
                        prompt_token_ids=prompt(g, 100), max_tokens=4000,
                        metadata={"sim_output_tokens": str(output)}) for m in range(4)]

    def scenario(client: RolloutClient, urls: list[str]) -> list:
        client.enqueue(groups(1, 40))  # the group the filter turns away: finished first
        assert wait_until(lambda: all(done(f"g1-{m}") for m in range(4)), timeout=30)
        client.enqueue([s for g in (0, 2, 3) for s in groups(g, 40)])  # quick
        client.enqueue([s for g in (4, 5) for s in groups(g, 3000)])  # the slow surplus
        batch = []
        while len(batch) < 8:  # two groups, never g1 (the filter turns it away whole)
            batch += client.results(8 - len(batch), by_group=True, timeout=5,
                                    group_filter=lambda g: g[0].group_id != "g1")
        client.ack()
        taken = {r.group_id for r in batch}
        rest = [f"g{g}" for g in range(6) if f"g{g}" not in taken]
        outcomes = client.cancel_groups(rest)
        t0 = time.monotonic()
        assert wait_until(lambda: engines_running(urls) == 0, timeout=5, every=0.01)
        stopped_s = time.monotonic() - t0
        time.sleep(0.5)
        late = client.results(100, timeout=0.5, by_group=True)
        return [batch, outcomes, stopped_s, late, client.filtered_groups]

    (batch, outcomes, stopped_s, late, filtered), _ = run_fleet(redis_url, namespace, scenario)
    taken = {r.group_id for r in batch}
    assert len(batch) == 8 and len(taken) == 2 and "g1" not in taken
    assert all(sum(r.group_id == g for r in batch) == 4 for g in taken)  # whole groups
    assert filtered == 1  # g1 was turned away, whole
    assert all(outcomes[f"g{g}-{m}"] == "cancelled" for g in (4, 5) for m in range(4))
    assert stopped_s < 1.0
    assert {r.group_id for r in late} <= {"g0", "g2", "g3"} - taken  # never the cancelled


def test_a_draining_worker_hands_its_sessions_back_with_what_they_generated(redis_url,
                                                                           namespace):
    sessions = long_sessions(4, "d")
    # The first engine runs in real time (~10 s for these outputs): the drain finds them all
    # running, whatever the machine's load; the second finishes them quickly.
    with running_engine(time_scale=1.0, kv_tokens=200_000) as e0, \
            running_engine(time_scale=10.0, kv_tokens=200_000) as e1:
        broker = BrokerThread(redis_url, namespace, make_policy("least_loaded")).start()
        client = RolloutClient(redis_url, namespace)
        first = WorkerThread(redis_url, namespace, "w0", e0.url, time_scale=1.0,
                             drain_grace_s=0.2).start()
        try:
            assert wait_until(lambda: client.status()["backends"].get("w0", {}).get("healthy"),
                              timeout=30)
            client.enqueue(sessions)
            assert wait_until(lambda: engines_running([e0.url]) == 4, timeout=30)
            time.sleep(0.3)  # some output to keep
            first.stop()  # SIGTERM's drain: grace, then cut short and handed back
            cut_at = generation_tokens(e0.url)
            assert 0 < cut_at < 4 * OUTPUT
            second = WorkerThread(redis_url, namespace, "w1", e1.url, time_scale=10.0).start()
            try:
                got = collect(client, 4)
            finally:
                second.stop()
        finally:
            broker.stop()
            client.close()
        finished_on_e1 = generation_tokens(e1.url)
    assert sorted(r.session_id for r in got) == [s.session_id for s in sessions]
    for r in got:
        assert r.status == SessionState.done and r.backend_id == "w1"
        assert r.output_tokens == OUTPUT  # the whole output, across both workers
        assert r.trajectory().loss_mask.count(1) == OUTPUT
        assert [t.turn for t in r.turn_records] == [0, 0]  # the part before and after the drain
        assert r.turn_records[0].input_token_ids and not r.turn_records[1].input_token_ids
    # Nothing was generated twice: what e0 made before the drain plus what e1 made after.
    assert cut_at + finished_on_e1 == 4 * OUTPUT
