"""The worker's own loops without Redis or an engine: publishing, a crashing session, tools."""

from __future__ import annotations

import asyncio

import pytest
import redis

from broker.session import Session, SessionResult, SessionState
from broker.completions import CompletionStats
from broker.worker_link import AdmittedSession
from tests.workers.tools_for_tests import TOOLS_TOML
from workers.runner import Outcome, Progress
from workers.tools import InlineExecutor, RegistryError, ToolError, load_registry
from workers.worker import Worker, WorkerSettings


class FlakyLink:
    """finish_many fails with each of `errors` in turn, then answers `replies`."""

    def __init__(self, errors: list[Exception], replies: list[str]) -> None:
        self.errors = list(errors)
        self.replies = replies
        self.calls = 0

    def finish_many(self, batch):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.replies[:len(batch)]


def worker() -> Worker:
    return Worker(WorkerSettings(backend_id="w0", redis_url="redis://127.0.0.1:1/0"),
                  "http://engine", InlineExecutor(registry=load_registry()))


def done(sid: str) -> tuple[SessionResult, CompletionStats]:
    return SessionResult(session_id=sid, workload="rlvr", status=SessionState.done), CompletionStats()


def test_a_finished_batch_is_retried_until_redis_takes_it():
    w = worker()
    w.link = FlakyLink([redis.ConnectionError("refused"), redis.TimeoutError("slow")],
                       ["ok", "ok"])
    assert asyncio.run(w._publish([done("a"), done("b")])) == ["ok", "ok"]
    assert w.link.calls == 3


def test_after_a_lost_reply_duplicate_means_it_was_ours():
    w = worker()
    # The first try ran in Redis but its reply was lost; the retry finds them finished.
    w.link = FlakyLink([redis.ConnectionError("reset")], ["duplicate", "stale"])
    assert asyncio.run(w._publish([done("a"), done("b")])) == ["ok", "stale"]
    w.link = FlakyLink([], ["duplicate"])  # no retry: someone else finished it
    assert asyncio.run(w._publish([done("a")])) == ["duplicate"]


def test_a_bug_in_a_session_ends_it_failed_with_the_reason():
    priorities = []

    class Broken:
        async def run(self, session, progress, checkpoint=None, priority=0):
            priorities.append(priority)
            raise KeyError("surprise")

    w = worker()
    s = Session(session_id="s1", workload="rlvr", prompt_token_ids=[1], max_tokens=4)

    async def go():
        await w._run_one(Broken(), AdmittedSession("1733000000123-0", s, 10), Progress("s1"))
        return w._finished.get_nowait()

    result, _ = asyncio.run(go())
    assert priorities == [1733000000123]  # the admitted entry's time, the engine's priority
    assert result.status == SessionState.failed and result.session_id == "s1"
    assert result.error == "worker: KeyError: 'surprise'"
    assert "s1" not in w._running


def test_registry_from_the_operators_file():
    reg = load_registry(TOOLS_TOML)
    assert {"sim", "boom", "slow", "exits"} <= set(reg.tools)
    assert {"parity", "bad", "exits"} <= set(reg.rewards)
    with pytest.raises(ToolError, match=r"^tool: 'nope' is not registered on this worker; "
                                        r"registered: boom, exits, sim, slow$"):
        reg.tool("nope")
    assert set(load_registry().tools) == {"sim"}  # without a file: the built-ins only


@pytest.mark.parametrize("text, message", [
    ('[tools]\nx = "no_such_module_rb:f"\n', r"^tool-config tools\.x: cannot import 'no_such_module_rb:f'"),
    ('[tools]\nx = "os.path"\n', r"^tool-config tools\.x: 'os.path' must be 'package.module:function'"),
    ('[tools]\nx = "os:sep"\n', r"^tool-config tools\.x: 'os:sep' is not callable"),
    ('[tools]\n"a:b" = "os:getcwd"\n', r"^tool-config tools\.a:b: key 'a:b' must be"),
    ('[tool]\nx = "os:getcwd"\n', r"^tool-config: unknown table\(s\) tool in"),
    ('[tools\n', r"^tool-config: .* is not valid TOML"),
])
def test_a_bad_registry_file_is_one_line_naming_the_entry(tmp_path, text, message):
    path = tmp_path / "tools.toml"
    path.write_text(text)
    with pytest.raises(RegistryError, match=message):
        load_registry(path)
    with pytest.raises(RegistryError, match=r"^tool-config: cannot read"):
        load_registry(tmp_path / "missing.toml")


def test_entry_points_of_installed_packages_register_tools(monkeypatch):
    from importlib.metadata import EntryPoint

    import workers.tools as tools

    def entry_points(group: str):
        if group == tools.TOOL_ENTRY_POINTS:
            return [EntryPoint("search", "tests.workers.tools_for_tests:boom", group)]
        return []

    monkeypatch.setattr(tools, "entry_points", entry_points)
    reg = load_registry()
    assert reg.tools["search"].__name__ == "boom" and set(reg.rewards) == {"parity"}


def test_a_finished_session_is_in_the_beats_until_its_result_is_published():
    # The broker requeues a session running here that the beats stop listing (broker/service.py
    # `_requeue_orphans`). Between a session's end and the finish loop's publish (a batch ahead
    # of it, a Redis outage's back-off) it is still `running` in Redis: it must stay listed.
    class Quick:
        async def run(self, session, progress, checkpoint=None, priority=0):
            progress.context_tokens = 9
            result = SessionResult(session_id=session.session_id, workload="rlvr",
                                   status=SessionState.done)
            return Outcome(result=result, stats=CompletionStats())

    w = worker()
    w.link = FlakyLink([], ["ok"])
    s = Session(session_id="s1", workload="rlvr", prompt_token_ids=[1], max_tokens=4)

    async def go():
        await w._run_one(Quick(), AdmittedSession("1-0", s, 10), Progress("s1"))
        assert "s1" not in w._running
        listed_before = [(p.session_id, p.context_tokens) for p in w._listed()]
        finisher = asyncio.create_task(w._finish_loop())
        await w._finished.join()
        finisher.cancel()
        return listed_before, [p.session_id for p in w._listed()]

    before, after = asyncio.run(go())
    assert before == [("s1", 9)]
    assert after == [] and w.link.calls == 1
