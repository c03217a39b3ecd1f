"""Run one admitted session on the engine: its turns, its tool calls, its reward.

Every turn is one call to vLLM's token-in, token-out `POST /inference/v1/generate`: token ids
in, the generated ids, their logprobs and the weights label of every span of them out (a request
frozen across a weight update by `pause(mode="keep")` says which tokens the new weights made).
Turn k+1's prompt is turn k's whole history (prompt + output ids + observation ids): the
engine's prefix cache serves everything but the new tail. A session given as `prompt_text` is
tokenized once by the engine (`/tokenize`, with the special tokens a completion would add).

Whose fault a failure is decides what happens to the session:
- the session's own (the engine refuses the request with a 4xx, a token id outside the
  vocabulary, its tool or reward fails or is not registered, its metadata cannot be read):
  it ends `failed` with the reason;
- the engine's (connection refused or broken, a timeout, 5xx after the retries with
  exponential backoff) or the tool service's: `run` raises `EngineUnavailable` (or
  `ToolUnavailable`) and the worker hands the session back to be run again, elsewhere if this
  engine is down (see workers/worker.py).
Nothing here touches Redis: the worker publishes what `run` returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx

from broker.heartbeat import SessionProgress
from broker.policies.base import kv_token_seconds
from broker.session import PartialRollout, Session, SessionResult, SessionState, TurnRecord
from broker.completions import CompletionStats
from workers.engine import GENERATE_PATH
from workers.tools import (
    RewardCall,
    ToolCall,
    ToolError,
    ToolExecutor,
    ToolUnavailable,
    describe_error,
    per_turn_value,
)

if TYPE_CHECKING:
    from workers.adapters import AdapterLoader

log = logging.getLogger("rollout_broker.worker")


class EngineError(RuntimeError):
    """The engine refused the session's request (a 4xx): the session's fault; says why."""


class Handoff(Exception):
    """The worker drains while the session runs: it goes back to the queue with what it had
    generated (`partial`), to go on elsewhere without generating anything twice."""

    def __init__(self, partial: PartialRollout) -> None:
        super().__init__("worker draining: session handed back with its partial output")
        self.partial = partial


@dataclass
class _TurnCut(Exception):
    """Inside a turn: the worker drains. What the turn had: its spans, the prompt ids of its
    first request (None if none was sent) and the context to continue from."""

    spans: list
    prompt_ids: list[int] | None
    context: list[int]
    done: int  # tokens of the turn generated so far, on any worker (those in `spans` included)


class EngineUnavailable(RuntimeError):
    """The engine did not serve a turn (unreachable, timed out, 5xx after the retries): not the
    session's fault, so it is handed back rather than failed; the message says why."""


@dataclass(slots=True)
class RunnerSettings:
    request_timeout_s: float = 600.0  # one turn's HTTP call (a long reasoning turn is minutes)
    retries: int = 3  # extra attempts after a 5xx / timeout / connection error
    backoff_s: float = 0.25  # first retry delay; doubles each attempt
    time_scale: float = 1.0  # simulated seconds per wall second, passed to simulated tools


@dataclass(slots=True)
class Progress:
    """A running session's progress; the worker's heartbeat reads it, the runner writes it."""

    session_id: str
    context_tokens: int = 0
    generated_tokens: int = 0
    turn: int = 0
    waiting_on_tool: bool = False

    def snapshot(self) -> SessionProgress:
        return SessionProgress(session_id=self.session_id, context_tokens=self.context_tokens,
                               generated_tokens=self.generated_tokens, turn=self.turn,
                               waiting_on_tool=self.waiting_on_tool)


@dataclass(frozen=True, slots=True)
class Turn:
    prompt_tokens: int
    output_token_ids: list[int]
    output_logprobs: list[float] | None  # the sampled tokens' (None: not requested)
    output_text: str  # as the engine detokenized it ("" unless the session's tools read text)
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens
    finish_reason: str | None
    wall_s: float
    # (policy version, start, end) over output_token_ids: which weights made which tokens
    versions: tuple[tuple[int, int, int], ...] = ()


@dataclass(slots=True)
class Outcome:
    result: SessionResult
    stats: CompletionStats
    turns: list[Turn] = field(default_factory=list)


def _sim_output_len(session: Session, turn: int) -> int | None:
    """A simulated session's true output length for `turn` (metadata `sim_output_tokens`)."""
    n = per_turn_value(session.metadata, "sim_output_tokens", turn)
    return None if n is None else int(n)


def _sampled_logprobs(choice: dict, tokens: int) -> list[float]:
    """The sampled tokens' logprobs from a generate choice (`logprobs.content[i].logprob`)."""
    content = (choice.get("logprobs") or {}).get("content")
    if content is None or len(content) != tokens:
        got = "none" if content is None else f"{len(content)}"
        raise EngineError(f"engine: reply has {got} logprobs for {tokens} output tokens "
                          "(it must honour sampling_params.logprobs)")
    return [float(c["logprob"]) for c in content]


def _version_spans(choice: dict, tokens: int, started_on: int,
                   label_version: Callable[[str], int | None]) -> tuple[tuple[int, int, int], ...]:
    """The reply's `weight_versions` (label, start, end) as (policy version, start, end) over
    its `tokens` output tokens; tokens no label covers, or whose label names no version, were
    made by the weights the request started on."""
    out: list[tuple[int, int, int]] = []
    at = 0
    for span in choice.get("weight_versions") or ():
        start, end = max(at, int(span["start"])), min(tokens, int(span["end"]))
        if start > at:
            out.append((started_on, at, start))
        if end > start:
            version = label_version(str(span["version"]))
            out.append((started_on if version is None else version, start, end))
            at = end
    if at < tokens:
        out.append((started_on, at, tokens))
    merged: list[tuple[int, int, int]] = []
    for v, a, b in out:
        if merged and merged[-1][0] == v:
            merged[-1] = (v, merged[-1][1], b)
        else:
            merged.append((v, a, b))
    return tuple(merged)


def wants_text(session: Session) -> bool:
    """Whether the session's tool or reward reads text: every one but the built-in simulated
    tool (`sim`) and stand-in reward (`parity`), which read token ids only. Only then do turns
    come back with their text, and tool calls with the conversation's."""
    return session.tool not in (None, "sim") or session.reward not in (None, "parity")


class EngineWeights:
    """What the worker's engine serves: the policy version (None until the namespace's trainer
    first resumes on a version: outputs then carry each session's own `policy_version`), and
    whether generation is paused for a weight update (the worker's control loop sets both)."""

    def __init__(self, version: int | None = None, labelled: bool = True) -> None:
        self.version = version
        # The worker labels the engine's weights with the version (False on an engine several
        # namespaces share: nothing changes its weights, and a label would be another's).
        self.labelled = labelled
        self.epoch = 0  # pauses seen
        self.draining = False  # the worker stops: cut sessions are handed back with their output
        self._generating = asyncio.Event()
        self._generating.set()
        self._pause_done = asyncio.Event()  # the worker has paused its engine and said so
        self._pause_done.set()

    @property
    def paused(self) -> bool:
        return not self._generating.is_set()

    def pause(self, epoch: int, mode: str) -> None:
        self.epoch = max(self.epoch, epoch)
        self._generating.clear()
        if mode == "abort":  # (`wait` lets requests finish: their replies are read at once)
            self._pause_done.clear()

    def pause_done(self) -> None:
        """The worker has paused its engine and acknowledged it (or given up trying)."""
        self._pause_done.set()

    async def after_pause_done(self) -> None:
        """Wait while the worker pauses its engine with `abort`: a reply the pause cut short
        is read after the acknowledgement, which the trainer is waiting for (on a busy host,
        parsing the replies first delays it); the turn waits for the resume anyway."""
        await self._pause_done.wait()

    def resume(self, version: int) -> None:
        self.version = version
        self._generating.set()

    def stop_serving(self) -> None:
        """The worker stops serving (it drains, or the weights of a resume could not be
        loaded): turns waiting for a resume wake, send nothing more, and are handed back with
        what they had."""
        self.draining = True
        self._generating.set()

    async def resumed(self) -> None:
        await self._generating.wait()

    def version_for(self, session: Session) -> int:
        return session.policy_version if self.version is None else self.version

    def label_version(self, label: str) -> int | None:
        """The policy version an engine's weights label names: the worker labels the engine's
        weights with the version it serves (`label_for`); None for any other label, or while
        the namespace serves no version (outputs then carry their session's own)."""
        if self.version is None or not self.labelled or not label.isdecimal():
            return None
        return int(label)

    @staticmethod
    def label_for(version: int | None) -> str:
        """The engine's weights label for `version` ("unversioned" while the namespace serves
        none, so no label an engine kept from an earlier job names a version)."""
        return "unversioned" if version is None else str(version)


@dataclass(frozen=True, slots=True)
class _Span:
    """One engine request of a turn: a whole turn, or its part before or after a pause."""

    output_token_ids: list[int]
    output_logprobs: list[float] | None
    finish_reason: str | None
    policy_version: int


@dataclass(slots=True)
class _Episode:
    """One `SessionRunner.run`: the session and what its run has produced so far."""

    session: Session
    progress: Progress
    history: list[int]  # every token id the engine has seen or produced, in order
    records: list[TurnRecord]  # the trajectory (with a resumed run's records first)
    first: int = 0  # the turn to start from
    done0: int = 0  # of that turn, output tokens already in `history` (a resumed cut turn)
    pending: list[int] = field(default_factory=list)  # ... and its input, not in a record yet
    resume: PartialRollout | None = None
    text: bool = False  # the tool reads text: detokenize the conversation for each call
    turns: list[Turn] = field(default_factory=list)  # the turns generated in this run
    observation: list[int] = field(default_factory=list)  # the tool's reply after the last turn
    tool_wait: float = 0.0
    waits: list[tuple[int, float]] = field(default_factory=list)  # (history, seconds) per tool
    prompt_tokens: int = 0
    truncated: bool = False
    reward: float | None = None
    error: str | None = None
    priority: int = 0  # vLLM's request priority of every turn (`SessionRunner.complete`)

    @classmethod
    def start(cls, session: Session, progress: Progress) -> _Episode:
        resume = session.resume_from
        # The whole conversation as text costs a /detokenize per tool call: only for tools
        # that read text.
        ep = cls(session, progress, list(session.prompt_token_ids or ()), [], resume=resume,
                 text=wants_text(session))
        if resume is not None:  # a worker drained while it ran: go on from what it had
            ep.records = list(resume.turn_records)
            ep.history = list(resume.history_token_ids)
            ep.first, ep.done0 = resume.turn, resume.turn_output_tokens
            ep.pending = list(resume.next_input_token_ids)
            progress.generated_tokens = sum(len(r.output_token_ids) for r in ep.records)
        return ep

    def outcome(self) -> Outcome:
        session, records, turns = self.session, self.records, self.turns
        result = SessionResult(
            session_id=session.session_id, workload=session.workload, group_id=session.group_id,
            group_size=session.group_size,
            status=SessionState.failed if self.error else SessionState.done,
            turns=len({r.turn for r in records}) if records else len(turns),
            prompt_tokens=(len(records[0].input_token_ids) if self.resume and records
                           else self.prompt_tokens),
            output_tokens=sum(len(r.output_token_ids) for r in records),
            cached_tokens=sum(t.cached_tokens for t in turns),
            turn_records=records, reward=self.reward, error=self.error,
            policy_version=session.policy_version)
        kv_seconds = kv_token_seconds(
            [(t.prompt_tokens, len(t.output_token_ids), t.wall_s) for t in turns], self.waits)
        stats = CompletionStats(turn_output_tokens=[len(t.output_token_ids) for t in turns],
                                tool_wait_s=self.tool_wait, kv_token_seconds=kv_seconds,
                                truncated=self.truncated)
        return Outcome(result=result, stats=stats, turns=turns)


class SessionRunner:
    def __init__(self, http: httpx.AsyncClient, engine_url: str, model: str, max_model_len: int,
                 tools: ToolExecutor | None, settings: RunnerSettings | None = None,
                 vocab_size: int | None = None, weights: EngineWeights | None = None,
                 adapters: AdapterLoader | None = None) -> None:
        self.weights = weights or EngineWeights()
        self.adapters = adapters  # None: the engine has LoRA off
        self.http = http
        self.base = engine_url.rstrip("/")
        self.model = model
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.tools = tools
        self.settings = settings or RunnerSettings()
        self._said_no_cached_tokens = False

    async def generate_turn(self, session: Session, prompt: list[int], turn: int,
                            max_tokens: int, done: int = 0, text: bool | None = None,
                            priority: int = 0) -> tuple[Turn, list[_Span]]:
        """One turn, whole even across a weight update: a request the engine aborts for a
        pause (`mode=abort`) keeps what it generated, and the turn goes on after the resume
        from prompt + that partial output, on the new weights (a partial rollout); a request
        a `keep` pause froze is split where the engine's weights label changed. Returns the
        turn and its spans, each with the policy version that generated it. `done`: tokens of
        the turn generated before (on another worker, which drained), already in `prompt`.
        `text`: ask for the output's text too (default: when the session's tools read it).
        `priority`: vLLM's request priority (`complete`)."""
        spans: list[_Span] = []
        parts: list[Turn] = []
        text = wants_text(session) if text is None else text
        first_prompt = prompt
        while True:
            await self.weights.resumed()  # no new request while paused: it waits for the version
            if self.weights.draining:
                raise _TurnCut(spans, first_prompt if parts else None, prompt, done)
            epoch = self.weights.epoch
            rec = await self.complete(session, prompt, turn, max_tokens - done, len(parts), done,
                                      text, priority)
            parts.append(rec)
            out, lps = rec.output_token_ids, rec.output_logprobs
            for version, a, b in rec.versions:
                spans.append(_Span(out[a:b], None if lps is None else lps[a:b],
                                   rec.finish_reason if b == len(out) else None, version))
            if not out:  # nothing generated (aborted before its first token): one empty span
                spans.append(_Span([], None if lps is None else [], rec.finish_reason,
                                   self.weights.version_for(session)))
            done += len(out)
            if rec.finish_reason != "abort":
                break
            if self.weights.draining:
                raise _TurnCut(spans, first_prompt, prompt + out, done)
            if not self.weights.paused and self.weights.epoch == epoch:
                raise EngineUnavailable("engine: aborted the request, and no pause was ordered")
            await self.weights.resumed()
            if done >= max_tokens:
                break
            prompt = prompt + out
        out = [t for p in parts for t in p.output_token_ids]  # this worker's, after `done`
        logprobs = None if parts[0].output_logprobs is None else \
            [v for p in parts for v in (p.output_logprobs or ())]
        whole = Turn(prompt_tokens=parts[0].prompt_tokens, output_token_ids=out,
                     output_logprobs=logprobs, output_text="".join(p.output_text for p in parts),
                     cached_tokens=sum(p.cached_tokens for p in parts),
                     finish_reason="length" if parts[-1].finish_reason == "abort"
                     else parts[-1].finish_reason,
                     wall_s=sum(p.wall_s for p in parts))
        return whole, spans

    async def complete(self, session: Session, prompt: list[int], turn: int, max_tokens: int,
                       piece: int = 0, done: int = 0, text: bool = False,
                       priority: int = 0) -> Turn:
        """One engine request: turn `turn`, or its part `piece` after a pause that found
        `done` tokens of it generated; with its text when `text`. `priority` (lower first) is
        sent as vLLM's request priority: an engine started with `--scheduling-policy
        priority` orders waiting requests and picks whom to preempt by it; one on the default
        `fcfs` ignores it."""
        s = session.sampling
        request_id = f"{session.session_id}-t{turn}" + (f"-p{piece}" if piece else "")
        params: dict = {"max_tokens": max_tokens, "temperature": s.temperature, "top_p": s.top_p,
                        "top_k": s.top_k, "min_p": s.min_p,
                        "repetition_penalty": s.repetition_penalty, "ignore_eos": s.ignore_eos}
        if s.stop:
            params["stop"] = list(s.stop)
        if s.stop_token_ids:
            params["stop_token_ids"] = list(s.stop_token_ids)
        if s.logprobs:
            params["logprobs"] = 0  # the sampled token's logprob only
        if s.seed is not None:
            params["seed"] = s.seed + turn
        sim_len = _sim_output_len(session, turn)
        extra: dict = {}
        if sim_len is not None:
            extra["sim_output_len"] = max(1, min(sim_len - done, max_tokens))
        sim_turns = session.metadata.get("sim_turns")
        if session.driver == "agent" and isinstance(sim_turns, int):
            # A simulated agent's episode: the simulated model calls a tool on every turn but
            # its true last one (the sim engine's hint, as `sim_output_len` is its length).
            extra["sim_tool_call"] = turn < sim_turns - 1
        if extra:
            params["extra_args"] = extra
        model = self.model if session.adapter is None or self.adapters is None \
            else self.adapters.engine_name(session.adapter)
        body = {"model": model, "token_ids": prompt,
                "request_id": request_id, "output_mode": "text" if text else "tokens",
                "sampling_params": params}
        if priority:
            body["priority"] = priority
        started_on = self.weights.version_for(session)
        started = time.monotonic()
        try:
            reply = await self._post(body)
        except EngineError as exc:
            if session.adapter is None or self.adapters is None or "HTTP 404" not in str(exc):
                raise
            # The engine lost the adapter (it restarted under this worker): load it again.
            self.adapters.forget(session.adapter)
            await self.adapters.acquire(session.adapter)
            self.adapters.release(session.adapter)
            reply = await self._post(body)
        choice = reply["choices"][0]
        usage = reply.get("usage") or {}
        details = usage.get("prompt_tokens_details")
        if details is None and not self._said_no_cached_tokens:
            self._said_no_cached_tokens = True
            log.warning("engine %s reports no cached prompt tokens (usage.prompt_tokens_details)"
                        ": start vLLM with --enable-prompt-tokens-details; until then every "
                        "turn's cached_tokens reads 0", self.base)
        details = details or {}
        ids = choice.get("token_ids")
        if ids is None:
            raise EngineError("engine: reply has no token_ids")
        return Turn(prompt_tokens=int(usage.get("prompt_tokens", len(prompt))),
                    output_token_ids=list(ids),
                    output_logprobs=_sampled_logprobs(choice, len(ids)) if s.logprobs else None,
                    output_text=str(choice.get("text") or ""),
                    cached_tokens=int(details.get("cached_tokens") or 0),
                    finish_reason=choice.get("finish_reason"),
                    wall_s=time.monotonic() - started,
                    versions=_version_spans(choice, len(ids), started_on,
                                            self.weights.label_version))

    async def detokenize(self, token_ids: list[int]) -> str:
        """Text of `token_ids` by the engine's tokenizer (vLLM's POST /detokenize)."""
        return str((await self._post(body={"model": self.model, "tokens": token_ids},
                                     path="/detokenize"))["prompt"])

    async def tokenize(self, text: str, special_tokens: bool = False) -> list[int]:
        """Token ids of `text` by the engine's tokenizer (vLLM's POST /tokenize); with the
        special tokens a completion prompt gets (a BOS) when `special_tokens`."""
        reply = await self._post(body={"model": self.model, "prompt": text,
                                       "add_special_tokens": special_tokens}, path="/tokenize")
        return [int(t) for t in reply["tokens"]]

    async def _post(self, body: dict, path: str = GENERATE_PATH) -> dict:
        cfg = self.settings
        url = self.base + path
        last = ""
        for attempt in range(cfg.retries + 1):
            if attempt:
                await asyncio.sleep(cfg.backoff_s * 2 ** (attempt - 1))
            try:
                r = await self.http.post(url, json=body, timeout=cfg.request_timeout_s)
            except httpx.TimeoutException:
                last = f"timed out after {cfg.request_timeout_s:g}s"
                continue
            except httpx.TransportError as exc:
                last = describe_error(exc)
                continue
            if r.status_code < 400:
                await self.weights.after_pause_done()
                return r.json()
            last = f"HTTP {r.status_code}: {r.text[:300]}"
            if r.status_code < 500:
                raise EngineError(f"engine: {last}")
        raise EngineUnavailable(f"engine: {last} (after {cfg.retries + 1} attempts)")

    async def run(self, session: Session, progress: Progress | None = None,
                  checkpoint: Callable[[PartialRollout], Awaitable[None]] | None = None,
                  priority: int = 0) -> Outcome:
        """Run the session to its end. Returns its outcome (`done`, or `failed` with the
        reason when the fault is the session's); raises `EngineUnavailable` when it is the
        engine's. `checkpoint` receives, after each turn whose tool answered, what the session
        would go on from (the worker stores it, so a dead worker or engine loses no finished
        turn). Every turn's request carries `priority` (`complete`)."""
        ep = _Episode.start(session, progress or Progress(session.session_id))
        ep.priority = priority
        holds = None
        try:
            self._check_vocabulary(session)
            if session.adapter is not None:
                if self.adapters is None:
                    raise EngineError(f"adapter: {session.adapter!r} needs LoRA, and this "
                                      "engine runs without --enable-lora")
                await self.adapters.acquire(session.adapter)
                holds = session.adapter
            if not ep.history and ep.resume is None:  # prompt_text: the engine tokenizes it once
                ep.history = await self.tokenize(session.prompt_text or "", special_tokens=True)
            for turn in range(ep.first, session.max_turns):
                if not await self._run_turn(ep, turn, checkpoint):
                    break
            if session.reward is not None:
                ep.reward = await self._score(ep)
        except (EngineError, ToolError) as exc:
            ep.error = str(exc)
        except (EngineUnavailable, ToolUnavailable, Handoff):
            raise
        except Exception as exc:
            # The session's data broke the run (metadata that is not what it claims): the
            # session's fault, so it ends failed with the reason instead of running forever.
            ep.error = f"session: {describe_error(exc)}"
        finally:
            ep.progress.waiting_on_tool = False
            if holds is not None:
                self.adapters.release(holds)
        return ep.outcome()

    async def _run_turn(self, ep: _Episode, turn: int,
                        checkpoint: Callable[[PartialRollout], Awaitable[None]] | None) -> bool:
        """Generate turn `turn` and call its tool; False when the episode ends here."""
        session, progress = ep.session, ep.progress
        resumed = ep.resume is not None and turn == ep.first
        before = ep.done0 if resumed else 0  # of this turn, already in `history`
        context = len(ep.history) - before
        max_tokens = min(session.max_tokens, self.max_model_len - context)
        if max_tokens < 1:  # the history fills the context: the episode ends here
            ep.truncated = True
            if turn == 0:
                raise EngineError(f"engine: prompt of {context} tokens leaves no room "
                                  f"under max_model_len {self.max_model_len}")
            return False
        progress.turn = turn + 1
        progress.context_tokens = context
        # The turn's input, unless a record already holds it (a resumed cut turn).
        fed_next = ep.pending if resumed else ep.observation
        try:
            rec, spans = await self.generate_turn(session, ep.history, turn, max_tokens, before,
                                                  priority=ep.priority)
        except _TurnCut as cut:
            raise self._handoff(ep.records, cut, turn, fed_next, before) from None
        ep.turns.append(rec)
        if turn == 0 and not resumed:
            ep.prompt_tokens = rec.prompt_tokens
            fed = ep.history
        else:
            fed = [] if before else fed_next
        for i, span in enumerate(spans):
            ep.records.append(TurnRecord(
                turn=turn, input_token_ids=fed if i == 0 else [],
                output_token_ids=span.output_token_ids,
                output_logprobs=span.output_logprobs, finish_reason=span.finish_reason,
                policy_version=span.policy_version))
        ep.history = ep.history + rec.output_token_ids
        progress.generated_tokens += len(rec.output_token_ids)
        progress.context_tokens = len(ep.history)
        ep.truncated = rec.finish_reason == "length"
        if turn + 1 >= session.max_turns or not await self._call_tool(ep, turn, rec):
            return False
        if checkpoint is not None:
            await checkpoint(PartialRollout(
                turn_records=list(ep.records), history_token_ids=ep.history, turn=turn + 1,
                next_input_token_ids=ep.observation))
        return True

    async def _call_tool(self, ep: _Episode, turn: int, rec: Turn) -> bool:
        """Run the session's tool on turn `turn`'s output; False when it ends the episode
        (else its observation joins the history)."""
        session, history = ep.session, ep.history
        ep.progress.waiting_on_tool = True
        t0 = time.monotonic()
        assert self.tools is not None, "a runner without tools only generates (the gateway's)"
        outcome = await self.tools.call_tool(ToolCall(
            session_id=session.session_id, workload=session.workload,
            tool=session.tool or "", turn=turn,
            max_turns=session.max_turns, output_token_ids=rec.output_token_ids,
            output_text=rec.output_text, history_token_ids=history,
            history_text=await self.detokenize(history) if ep.text else "",
            context_tokens=len(history), metadata=dict(session.metadata),
            time_scale=self.settings.time_scale))
        ep.observation = list(outcome.observation_token_ids)
        if outcome.observation_text:
            ep.observation += await self.tokenize(outcome.observation_text)
        waited = time.monotonic() - t0
        ep.tool_wait += waited
        ep.waits.append((len(history), waited))
        ep.progress.waiting_on_tool = False
        if outcome.done:
            return False
        ep.history = history + ep.observation
        return True

    async def _score(self, ep: _Episode) -> float:
        """The session's reward from its scorer, on the whole trajectory."""
        session = ep.session
        ep.progress.waiting_on_tool = True
        trajectory = SessionResult(session_id=session.session_id,
                                   workload=session.workload, status=SessionState.done,
                                   turn_records=ep.records).trajectory()
        assert self.tools is not None, "a runner without tools only generates (the gateway's)"
        return await self.tools.score(RewardCall(
            session_id=session.session_id, workload=session.workload,
            scorer=session.reward,
            output_token_ids=[t.output_token_ids for t in ep.turns],
            output_texts=[t.output_text for t in ep.turns],
            token_ids=trajectory.token_ids, loss_mask=trajectory.loss_mask,
            metadata=dict(session.metadata), time_scale=self.settings.time_scale))

    @staticmethod
    def _handoff(records: list[TurnRecord], cut: _TurnCut, turn: int, fed_next: list[int],
                 before: int) -> Exception:
        """What to raise when the worker drains inside `turn` (`before` of its tokens came
        from an earlier worker): a Handoff with the session's partial output, or, if nothing
        was generated yet, a plain hand back."""
        spans = cut.spans
        if not records and not spans:
            return EngineUnavailable("worker draining: session handed back before it started")
        # The cut turn's input goes in its first new record, unless a record already has it.
        recorded = before > 0
        first_input = [] if recorded else ((cut.prompt_ids or []) if turn == 0 else fed_next)
        records = records + [
            TurnRecord(turn=turn, input_token_ids=first_input if i == 0 else [],
                       output_token_ids=sp.output_token_ids, output_logprobs=sp.output_logprobs,
                       finish_reason=sp.finish_reason, policy_version=sp.policy_version)
            for i, sp in enumerate(spans)]
        return Handoff(PartialRollout(
            turn_records=records, history_token_ids=list(cut.context), turn=turn,
            turn_output_tokens=cut.done,
            next_input_token_ids=[] if recorded or spans else list(fed_next)))

    def _check_vocabulary(self, session: Session) -> None:
        if self.vocab_size is not None and session.prompt_token_ids:
            top = max(session.prompt_token_ids)
            if top >= self.vocab_size:
                raise EngineError(f"prompt_token_ids: token id {top} is not below the engine's "
                                  f"vocabulary size {self.vocab_size}")
