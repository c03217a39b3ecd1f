"""The session gateway's work for one call: admission, the engine, the episode's records.

Stateless between calls: everything an episode is lives in Redis (broker/episodes.py), so any
number of gateways serve the same episodes behind a load balancer, and a gateway killed
mid-call loses nothing: the agent's retry runs the call again (on any gateway), and a call
whose records were written before the kill is answered from them, never run twice.

One call, in order:
1. read the episode; a call that repeats the last recorded one (the agent retried after a lost
   reply) gets the recorded reply;
2. its prompt: the episode's ids so far plus the new messages' tokens (gateway/render.py);
3. admission: a parked episode asks for it and waits (bounded: then 429 with Retry-After)
   until the broker's policy places it; an admitted one starts the call on its backend;
4. generation on that backend's engine, token-in, token-out (`SessionRunner.generate_turn`, as
   a worker runs a turn: a weight-update pause holds the call, an `abort` pause cuts it and it
   goes on after the resume); an engine that dies moves the episode (the broker requeues it),
   and the call runs again where it is admitted next;
5. the reply: text and tool calls (vLLM's hermes format, broker/tool_calls.py), recorded with
   the call's turn records (`commit_call`) before it is sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from broker.episodes import (
    CallRecord,
    EpisodeView,
    begin_call,
    commit_call,
    read_reply,
    read_spec,
    read_text,
    read_turns,
    read_view,
    request_admission,
    session_for,
)
from broker.keys import Keys
from broker.plans import AsyncRunner, Plan
from broker.policies.base import kv_token_seconds
from broker.redis_conn import Outage, connect_async, is_outage
from broker.session import Session, SessionResult, SessionState, TurnRecord
from broker.streams import as_text
from broker.tool_calls import parse_tool_calls, tool_call_id
from broker.weights import read_state
from gateway.render import ChatRenderer, EngineTemplate, HfTemplate, RenderError, SimTemplate
from workers.engine_http import engine_client
from workers.runner import EngineError, EngineUnavailable, EngineWeights, RunnerSettings, SessionRunner
from workers.tools import InlineExecutor, RewardCall, ToolError, load_registry

log = logging.getLogger("rollout_broker.gateway")
T = TypeVar("T")


class GatewayError(Exception):
    """An OpenAI-shaped error reply: `status`, and the body's message, type, param, code."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    @property
    def type(self) -> str:
        if self.status == 429:
            return "rate_limit_error"
        return "invalid_request_error" if self.status < 500 else "server_error"


@dataclass(slots=True)
class GatewaySettings:
    redis_url: str
    namespace: str = "default"
    admission_timeout_s: float = 30.0  # a call waits this long to be admitted, then 429
    move_timeout_s: float = 120.0  # a call whose engine died waits this long for another
    call_timeout_s: float = 600.0  # one engine request; also how long a call holds its charge
    retry_after_s: float = 2.0  # the 429's Retry-After
    max_connections: int = 1024  # HTTP connections to the engines, all together
    redis_connections: int = 1024  # Redis connections (every call in flight may hold one)
    token: str | None = None  # bearer token of the trainer's endpoints (None: open)
    # Where the chat template comes from (gateway/render.py): "engine", "sim" or a Hugging Face
    # tokenizer name or path.
    tokenizer: str = "engine"
    # The reward scorers a close may name (workers/tools.py: built-ins, entry points, this TOML
    # file; default $RB_TOOL_CONFIG).
    tool_config: str | None = None
    reward_timeout_s: float = 60.0
    runner: RunnerSettings = field(default_factory=RunnerSettings)


@dataclass(frozen=True, slots=True)
class ChatCall:
    """What one chat call asks, as the HTTP layer validated it."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: Any
    max_tokens: int | None
    model: str | None


@dataclass(frozen=True, slots=True)
class CompletionCall:
    """What one completions call asks: one prompt, as text or token ids."""

    prompt: str | list[int]
    max_tokens: int | None
    model: str | None


@dataclass(slots=True)
class CallTiming:
    """Where a call's time went (seconds): waiting for admission, in the engine's requests,
    and in all (the rest is the gateway's own work: rendering, Redis, the reply)."""

    admission_s: float = 0.0
    render_s: float = 0.0  # the chat template, by the engine's tokenizer
    engine_s: float = 0.0
    total_s: float = 0.0

    def header(self) -> str:
        """As an HTTP `Server-Timing` header (milliseconds)."""
        return ", ".join(f"{name};dur={value * 1e3:.3f}" for name, value in (
            ("admission", self.admission_s), ("render", self.render_s),
            ("engine", self.engine_s), ("total", self.total_s)))


@dataclass(slots=True)
class _Backend:
    url: str
    model: str
    runner: SessionRunner
    renderer: ChatRenderer


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.keys = Keys(settings.namespace)
        self._redis = connect_async(settings.redis_url, max_connections=settings.redis_connections)
        self._outage = Outage("gateway", log)
        self._runner = AsyncRunner(self._redis, self._outage)
        # One client for every engine (workers/engine_http.py: aiohttp's pool, whose cost per
        # request does not grow with the connections it holds).
        self._http = engine_client(settings.call_timeout_s, settings.max_connections)
        self.weights = EngineWeights()
        self._renderers: dict[object, ChatRenderer] = {}
        if settings.tokenizer not in ("engine", "sim"):
            self._renderers["hf"] = ChatRenderer(HfTemplate(settings.tokenizer))
        self._backends: dict[str, _Backend] = {}
        self._live: list[str] = []  # live backends, as last read (`_any_backend`)
        self._live_at = -1e9
        self._specs: OrderedDict[str, Session] = OrderedDict()
        self._history: OrderedDict[str, tuple[int, list[int]]] = OrderedDict()
        self._waiters: dict[str, asyncio.Event] = {}
        # The rewards a close may name (`score`); a bad --tool-config fails here, at start.
        self._scorer = InlineExecutor(settings.reward_timeout_s,
                                      load_registry(settings.tool_config))
        self._tasks: list[asyncio.Task] = []
        self._trimmed = 0.0  # when this gateway last trimmed the admissions stream
        self.calls = 0  # calls answered

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        state = await self._redis_call(read_state, self.keys)
        self.weights.version = state.version
        if state.paused:
            self.weights.pause(state.epoch, state.paused)
            self.weights.pause_done()  # the workers pause the engines; we only hold calls
        # From the admissions stream's last entry now ("$" on every read would miss entries
        # that land between two reads).
        last = await self._redis.xrevrange(self.keys.episodes_admitted, count=1)
        admitted_after = as_text(last[0][0]) if last else "0"
        self._tasks = [
            asyncio.create_task(self._follow(self.keys.control, state.control_id,
                                             self._on_control), name="gateway-control"),
            asyncio.create_task(self._follow(self.keys.episodes_admitted, admitted_after,
                                             self._on_admitted,
                                             self._trim_admitted), name="gateway-admissions")]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._http.aclose()
        await self._redis.aclose()

    async def _redis_call(self, plan: Callable[..., Plan[T]], *args: Any) -> T:
        """Run a plan, waiting out a Redis outage for up to the admission timeout (then 503)."""
        deadline = time.monotonic() + self.settings.admission_timeout_s
        while True:
            try:
                return await self._runner.run(plan(*args))
            except Exception as exc:
                if not is_outage(exc):
                    raise
                if time.monotonic() >= deadline:
                    raise GatewayError(503, f"redis: {exc}", code="redis_unavailable",
                                       retry_after_s=self.settings.retry_after_s) from exc
                await asyncio.sleep(self._outage.failed(exc))

    async def _follow(self, stream: str, after: str, handle: Callable[[str, dict], None],
                      every: Callable[[], Awaitable[None]] | None = None) -> None:
        """Read `stream` (no group: every gateway reads it all) from `after` on, handing each
        entry's fields, as text, to `handle`; `every` runs after each read. Outages are waited
        out."""
        while True:
            try:
                reply = await self._redis.xread({stream: after}, count=1000, block=1000)
                if every is not None:
                    await every()
            except Exception as exc:
                if not is_outage(exc):
                    raise
                await asyncio.sleep(self._outage.failed(exc))
                continue
            for _, entries in reply or []:
                for eid, raw in entries:
                    after = as_text(eid)
                    handle(after, {as_text(k): as_text(v) for k, v in raw.items()})

    def _on_control(self, _: str, f: dict) -> None:
        """Weight updates (broker/weights.py): hold calls while paused; version the tokens."""
        if f.get("op") == "pause":
            self.weights.pause(int(f.get("epoch", 0)), f.get("mode", "keep"))
            self.weights.pause_done()
        elif f.get("op") == "resume":
            self.weights.resume(int(f.get("version", 0)))

    def _on_admitted(self, _: str, f: dict) -> None:
        """Wake the call waiting for an episode the broker just admitted."""
        waiter = self._waiters.get(f.get("sid", ""))
        if waiter is not None:
            waiter.set()

    async def _trim_admitted(self) -> None:
        """Entries older than a minute: no call waits for them (every 10 s, by any gateway)."""
        if time.monotonic() - self._trimmed > 10.0:
            self._trimmed = time.monotonic()
            await self._redis.xtrim(self.keys.episodes_admitted,
                                    minid=f"{int((time.time() - 60) * 1000)}-0", approximate=True)

    # -- engines --------------------------------------------------------------------------------
    async def _backend(self, backend_id: str) -> _Backend:
        b = self._backends.get(backend_id)
        if b is None:
            f = await self._redis.hmget(self.keys.ledger(backend_id), "engine_url", "model",
                                        "max_model_len", "vocab_size")
            url, model, max_len, vocab = (as_text(x) if x is not None else None for x in f)
            if not url or not model:
                raise EngineUnavailable(f"backend {backend_id}: its worker did not advertise its "
                                        "engine (a worker older than the gateway?)")
            runner = SessionRunner(self._http, url, model, int(max_len or 0), tools=None,
                                   settings=self.settings.runner,
                                   vocab_size=int(vocab) if vocab else None, weights=self.weights)
            b = self._backends[backend_id] = _Backend(url.rstrip("/"), model, runner,
                                                      self._renderer(url, model, vocab))
        return b

    def _renderer(self, url: str, model: str, vocab: str | None) -> ChatRenderer:
        tok = self.settings.tokenizer
        if tok == "engine":
            key: object = ("engine", url, model)
            make = lambda: EngineTemplate(self._http, url.rstrip("/"), model)  # noqa: E731
        elif tok == "sim":
            if not vocab:
                raise EngineUnavailable(f"engine {url}: its worker registered no vocabulary size "
                                        "(--tokenizer sim needs it)")
            key, make = ("sim", int(vocab)), lambda: SimTemplate(int(vocab))  # noqa: E731
        else:
            return self._renderers["hf"]
        renderer = self._renderers.get(key)
        if renderer is None:
            renderer = self._renderers[key] = ChatRenderer(make())
        return renderer

    def served_models(self) -> list[str]:
        """The models of the engines this gateway has called."""
        return sorted({b.model for b in self._backends.values()})

    async def _any_backend(self) -> _Backend:
        """A live backend's engine, to render a first call's messages before admission (the
        live set read at most once a second, in one round trip)."""
        now = time.monotonic()
        if now - self._live_at > 1.0:
            ids = sorted(as_text(x) for x in await self._redis.smembers(self.keys.backends))
            pipe = self._redis.pipeline(transaction=False)
            for b in ids:
                pipe.exists(self.keys.heartbeat(b))
            self._live = [b for b, ok in zip(ids, await pipe.execute()) if ok]
            self._live_at = now
        for b in self._live:
            try:
                return await self._backend(b)
            except EngineUnavailable:
                continue
        raise GatewayError(503, "no live backend: start a worker (rollout-broker worker)",
                           code="no_backend", retry_after_s=self.settings.retry_after_s)

    # -- episodes -------------------------------------------------------------------------------
    async def spec(self, sid: str) -> Session:
        spec = self._specs.get(sid)
        if spec is None:
            spec = await self._redis_call(read_spec, self.keys, sid)
            if spec is None:
                raise GatewayError(404, f"episode {sid!r} is not open in namespace "
                                   f"{self.keys.namespace!r}", code="episode_not_found")
            self._specs[sid] = spec
            while len(self._specs) > 65536:
                self._specs.popitem(last=False)
        return spec

    async def view(self, sid: str) -> EpisodeView:
        view = await self._redis_call(read_view, self.keys, sid)
        if view.state is None:
            raise GatewayError(404, f"episode {sid!r} is not open in namespace "
                               f"{self.keys.namespace!r}", code="episode_not_found")
        if view.ended:
            raise GatewayError(409, f"episode {sid!r} has ended ({view.state})",
                               code="episode_ended")
        return view

    async def history(self, sid: str, view: EpisodeView) -> list[int]:
        """The episode's token ids so far: every record's input then output, in order."""
        cached = self._history.get(sid)
        if cached is not None and cached[0] == view.turns:
            return cached[1]
        records = await self._redis_call(read_turns, self.keys, sid)
        ids = [t for r in records for t in (*r.input_token_ids, *r.output_token_ids)]
        self._remember(sid, view.turns, ids)
        return ids

    def _remember(self, sid: str, turns: int, ids: list[int]) -> None:
        self._history[sid] = (turns, ids)
        self._history.move_to_end(sid)
        while len(self._history) > 4096:
            self._history.popitem(last=False)

    async def score(self, sid: str, scorer: str) -> float:
        """The episode's reward from a registered scorer (workers/tools.py), on its whole
        trajectory and each call's output text, as a worker scores a session."""
        spec = await self.spec(sid)
        view = await self.view(sid)
        records = await self._redis_call(read_turns, self.keys, sid)
        per_turn: dict[int, list[int]] = {}
        for r in records:
            per_turn.setdefault(r.turn, []).extend(r.output_token_ids)
        outputs = [per_turn[t] for t in sorted(per_turn)]
        engine = await (self._backend(view.backend) if view.backend else self._any_backend())
        texts = [await engine.runner.detokenize(ids) for ids in outputs]
        trajectory = SessionResult(session_id=sid, workload=spec.workload,
                                   status=SessionState.done, turn_records=records).trajectory()
        try:
            return await self._scorer.score(RewardCall(
                session_id=sid, workload=spec.workload, scorer=scorer, output_token_ids=outputs,
                output_texts=texts, token_ids=trajectory.token_ids,
                loss_mask=trajectory.loss_mask, metadata=dict(spec.metadata)))
        except ToolError as exc:
            raise GatewayError(400, f"reward_name: {exc}", param="reward_name") from exc

    # -- one call -------------------------------------------------------------------------------
    async def chat(self, sid: str, call: ChatCall) -> tuple[dict[str, Any], CallTiming]:
        """One chat call: the reply (an OpenAI chat completion) and where its time went. The
        call's mark is its message count: it sends the episode's messages (the last one the
        previous reply) and at least one new one."""
        n = len(call.messages)

        def check(view: EpisodeView) -> None:
            held = view.mark + 1  # the last call's messages and its reply
            if n <= held or call.messages[held - 1].get("role") != "assistant":
                raise GatewayError(400, f"messages: the episode holds {held} messages, the last "
                                   "the assistant's reply; a call sends them all, then at least "
                                   "one new one", param="messages")

        async def added(engine: _Backend, view: EpisodeView, history: list[int]) -> list[int]:
            if not view.turns:
                return await engine.renderer.first(call.messages, call.tools)
            return await engine.renderer.next_input(history[-1] if history else None,
                                                    call.messages[view.mark + 1:], call.tools)

        def reply(turn: int, model: str, text: str, finish: str | None, prompt_tokens: int,
                  completion_tokens: int, created: float) -> dict[str, Any]:
            return self._chat_reply(sid, turn, call, model, text, finish, prompt_tokens,
                                    completion_tokens, created)

        return await self._call(sid, n, call.max_tokens, check, added, reply, None, None)

    async def complete(self, sid: str, call: CompletionCall) -> tuple[dict[str, Any], CallTiming]:
        """One completions call: its prompt (text or token ids) is the episode so far, the
        previous prompt and completion, plus new text or ids; its mark is the prompt's length."""
        text_prompt = isinstance(call.prompt, str)
        mark = len(call.prompt)
        so_far: list[str] = []  # a text episode's text so far (read by `prepare`)

        async def added(engine: _Backend, view: EpisodeView, history: list[int]) -> list[int]:
            if text_prompt:
                text = so_far[0] if view.turns else ""
                if not call.prompt.startswith(text):
                    raise GatewayError(400, "prompt: must extend the episode's text so far (the "
                                       "last prompt and its completion)", param="prompt")
                return await engine.renderer.source.encode(call.prompt[len(text):])
            if call.prompt[:len(history)] != history:
                raise GatewayError(400, "prompt: must extend the episode's token ids so far (the "
                                   "last prompt and its completion)", param="prompt")
            return list(call.prompt[len(history):])

        def check(view: EpisodeView) -> None:
            if mark <= (len(so_far[0]) if text_prompt and so_far else 0):
                raise GatewayError(400, "prompt: must add to the episode's text so far",
                                   param="prompt")

        async def prepare(view: EpisodeView) -> None:
            if text_prompt and view.turns:
                so_far.append(await self._redis_call(read_text, self.keys, sid))

        def reply(turn: int, model: str, text: str, finish: str | None, prompt_tokens: int,
                  completion_tokens: int, created: float) -> dict[str, Any]:
            out = {"id": f"cmpl-{sid}-{turn}-{uuid.uuid4().hex[:8]}", "object": "text_completion",
                   "created": int(created), "model": call.model or model,
                   "choices": [{"index": 0, "text": text, "logprobs": None,
                                "finish_reason": finish or "stop"}],
                   "usage": {"prompt_tokens": prompt_tokens,
                             "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}}
            return out

        def text_after(out: dict[str, Any]) -> str:
            return call.prompt + out["choices"][0]["text"] if text_prompt else ""

        return await self._call(sid, mark, call.max_tokens, check, added, reply, prepare,
                                text_after)

    async def _call(self, sid: str, mark: int, max_tokens: int | None, check, added, reply,
                    prepare, text_after=None) -> tuple[dict[str, Any], CallTiming]:
        """The steps every call takes (the module's docstring); `check`, `added` and `reply`
        are the endpoint's: whether the call extends the episode, the tokens it adds, the
        reply's shape."""
        timing = CallTiming()
        t0 = time.perf_counter()
        started = time.time()
        spec = await self.spec(sid)
        view = await self.view(sid)
        if view.turns and mark == view.mark:  # the last call again: its reply, not a rerun
            stored = await self._redis_call(read_reply, self.keys, sid)
            if stored is not None:
                timing.total_s = time.perf_counter() - t0
                return _loads(stored), timing
        if view.turns >= spec.max_turns:
            raise GatewayError(400, f"messages: episode {sid!r} has made its max_turns "
                               f"({spec.max_turns}) calls", param="messages",
                               code="max_turns_reached")
        if prepare is not None:
            await prepare(view)
        if view.turns:
            check(view)
        history = await self.history(sid, view) if view.turns else []
        engine = await (self._backend(view.backend) if view.backend else self._any_backend())
        t1 = time.perf_counter()
        try:
            new = await added(engine, view, history)
        except RenderError as exc:
            raise GatewayError(400, f"messages: {exc}", param="messages") from exc
        except httpx.HTTPError as exc:
            raise GatewayError(503, f"engine: could not render the messages: {exc}",
                               code="engine_unavailable",
                               retry_after_s=self.settings.retry_after_s) from exc
        timing.render_s = time.perf_counter() - t1
        prompt = history + new
        turn, spans, backend = await self._generate(sid, spec, view, prompt, max_tokens, timing)
        records = [TurnRecord(turn=view.turns, input_token_ids=new if i == 0 else [],
                              output_token_ids=s.output_token_ids,
                              output_logprobs=s.output_logprobs, finish_reason=s.finish_reason,
                              policy_version=s.policy_version) for i, s in enumerate(spans)]
        out = reply(view.turns, self._backends[backend].model if backend in self._backends
                    else engine.model, turn.output_text, turn.finish_reason, len(prompt),
                    len(turn.output_token_ids), started)
        call_s = time.time() - started
        wait_s = max(0.0, started - view.last_call_at) if view.last_call_at else 0.0
        outcome = await self._redis_call(commit_call, self.keys, sid, CallRecord(
            backend=backend, calls_before=view.turns, mark=mark, reply_json=_dumps(out),
            context_tokens=len(prompt) + len(turn.output_token_ids), agent_wait_s=wait_s,
            kv_token_s=kv_token_seconds([(len(prompt), len(turn.output_token_ids), call_s)],
                                        [(view.context_tokens, wait_s)]),
            records=tuple(records), text=text_after(out) if text_after else ""))
        if outcome == "conflict":  # the same call ran twice (a retry); the first one counts
            stored = await self._redis_call(read_reply, self.keys, sid)
            if stored is None:
                raise GatewayError(409, f"episode {sid!r} moved on while this call ran",
                                   code="episode_conflict")
            out = _loads(stored)
        elif outcome != "ok":
            raise GatewayError(409, f"episode {sid!r} has ended ({outcome})", code="episode_ended")
        else:
            self._remember(sid, view.turns + 1, prompt + turn.output_token_ids)
            self.calls += 1
        timing.total_s = time.perf_counter() - t0
        return out, timing

    async def _generate(self, sid: str, spec: Session, view: EpisodeView, prompt: list[int],
                        max_tokens: int | None, timing: CallTiming):
        """Admit the episode if it must be, start the call on its backend and generate; an
        engine that fails moves the episode (the broker requeues it) and the call goes on where
        it is admitted next. Returns (turn, spans, backend id)."""
        s = self.settings
        admit_by = time.monotonic() + s.admission_timeout_s
        move_by: float | None = None
        while True:
            t0 = time.perf_counter()
            backend = await self._place(sid, spec, view, prompt, admit_by, move_by)
            timing.admission_s += time.perf_counter() - t0
            b = await self._backend(backend)
            room = b.runner.max_model_len - len(prompt) if b.runner.max_model_len else None
            limit = min(x for x in (spec.max_tokens, max_tokens, room) if x is not None)
            if limit < 1:
                raise GatewayError(400, f"messages: the episode's context ({len(prompt)} tokens) "
                                   f"fills the model's {b.runner.max_model_len}",
                                   param="messages", code="context_length_exceeded")
            try:
                t0 = time.perf_counter()
                # Older episodes first on an engine scheduling by priority, as the workers'
                # sessions (by admission time; this call's own admission is now).
                admitted = view.admitted_at if view.admitted_at is not None else time.time()
                turn, spans = await b.runner.generate_turn(spec, prompt, view.turns, limit,
                                                           text=True,
                                                           priority=int(admitted * 1000))
                timing.engine_s += time.perf_counter() - t0
                return turn, spans, backend
            except EngineError as exc:
                raise GatewayError(400, str(exc), param="messages") from exc
            except EngineUnavailable as exc:
                log.warning("episode %s: %s; waiting for it to move", sid, exc)
                self._backends.pop(backend, None)
                move_by = move_by or time.monotonic() + s.move_timeout_s
                view = await self._moved(sid, backend, move_by)

    async def _moved(self, sid: str, backend: str, by: float) -> EpisodeView:
        """Wait until the episode is no longer placed on `backend` (the broker took it back)."""
        while True:
            view = await self.view(sid)
            if view.backend != backend or view.state not in ("admitted", "running"):
                return view
            if time.monotonic() >= by:
                raise GatewayError(503, f"engine of backend {backend} does not answer and the "
                                   "episode was not moved", code="engine_unavailable",
                                   retry_after_s=self.settings.retry_after_s)
            await asyncio.sleep(0.25)

    async def _place(self, sid: str, spec: Session, view: EpisodeView, prompt: list[int],
                     admit_by: float, move_by: float | None) -> str:
        """The backend the call runs on, the episode admitted there and its call begun."""
        by = max(admit_by, move_by or 0.0)
        waiter = self._waiters.setdefault(sid, asyncio.Event())
        try:
            while True:
                if view.state == "parked":  # never admitted yet, or released: then the front
                    await self._redis_call(request_admission, self.keys,
                                           session_for(spec, prompt, view.turns),
                                           view.releases > 0)
                elif view.state in ("admitted", "running") and view.backend:
                    deadline = time.time() + self.settings.call_timeout_s
                    began = await self._redis_call(begin_call, self.keys, sid, view.backend,
                                                   deadline)
                    if began == "ok":
                        return view.backend
                if time.monotonic() >= by:
                    raise GatewayError(
                        429, f"episode {sid!r} is waiting for admission (the fleet is full); "
                        "call again", code="admission_pending",
                        retry_after_s=self.settings.retry_after_s)
                if view.state == "pending":  # woken by the broker's announcement, or in 1 s
                    try:
                        await asyncio.wait_for(waiter.wait(), min(1.0, by - time.monotonic()))
                    except TimeoutError:
                        pass
                waiter.clear()  # before the read: an announcement after it wakes the next wait
                view = await self.view(sid)
        finally:
            self._waiters.pop(sid, None)

    def _chat_reply(self, sid: str, turn: int, call: ChatCall, model: str, text: str,
               finish_reason: str | None, prompt_tokens: int, completion_tokens: int,
               created: float) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if call.tools and call.tool_choice != "none":
            parsed = parse_tool_calls(text)
            if parsed.calls:
                message["content"] = parsed.content
                message["tool_calls"] = [
                    {"id": tool_call_id(), "type": "function",
                     "function": {"name": c.name, "arguments": c.arguments}}
                    for c in parsed.calls]
                finish_reason = "tool_calls"
        return {
            "id": f"chatcmpl-{sid}-{turn}-{uuid.uuid4().hex[:8]}", "object": "chat.completion",
            "created": int(created), "model": call.model or model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": finish_reason or "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _loads(raw: str) -> dict[str, Any]:
    return json.loads(raw)
