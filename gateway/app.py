"""The session gateway's HTTP API (`rollout-broker gateway`).

For the agent, each episode is an OpenAI API root, `/sessions/{episode_id}/v1`: an unmodified
`openai` client with `base_url` set to it calls `chat.completions.create(...)` (streaming or
not, with `tools`) as it would call any OpenAI-compatible server. For the trainer (or an agent
runner not written in Python): `POST /v1/episodes` opens one, `POST /v1/episodes/{id}/close`
ends it with its reward, `GET /v1/results` hands over finished results.

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the field
named in `param`; a call that waits too long for admission gets 429 with `Retry-After`, which
the `openai` client honours on its own retries.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from redis.exceptions import RedisError

from broker.client import AsyncRolloutClient
from broker.redis_conn import is_outage
from gateway.service import (CallTiming, ChatCall, CompletionCall, Gateway, GatewayError,
                             GatewaySettings)

log = logging.getLogger("rollout_broker.gateway")

ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatMessage(BaseModel):
    """One message as OpenAI's API takes it (content as text or parts; tool calls as given)."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatCompletionRequest(BaseModel):
    """OpenAI's chat completion request. Sampling is the episode's (the trainer sets it when it
    opens the episode, as RL needs): the agent's `temperature`, `top_p` and the like are read
    and left aside. `max_tokens` / `max_completion_tokens` cap this call below the episode's
    own cap."""

    model_config = ConfigDict(extra="allow")

    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=1)
    logprobs: bool | None = None


class CompletionRequest(BaseModel):
    """OpenAI's (legacy) completions request: one prompt, text or token ids, that extends the
    episode's text or ids so far. Sampling is the episode's, as for chat."""

    model_config = ConfigDict(extra="allow")

    prompt: str | list[int] = Field(min_length=1)
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=1)
    logprobs: int | None = Field(default=None, le=0)
    echo: bool = Field(default=False, le=False)


class EpisodeOpenReply(BaseModel):
    episode_id: str
    base_url: str


class EpisodeClose(BaseModel):
    """The reward, or the registered scorer (`reward_name`, workers/tools.py) to compute it on
    the episode's trajectory; neither: no reward."""

    model_config = ConfigDict(extra="forbid")

    reward: float | None = None
    reward_name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.\-]{1,64}$")


class EpisodeCloseReply(BaseModel):
    episode_id: str
    outcome: str  # 'ok', or the state it had ended in
    reward: float | None = None


def _error(exc: GatewayError) -> JSONResponse:
    headers = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    return JSONResponse(status_code=exc.status, headers=headers, content={"error": {
        "message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}})


def _field(loc: tuple | list) -> str:
    parts = [p for p in loc if p not in ("body", "query", "path")]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "body"


def create_app(settings: GatewaySettings, public_url: str = "") -> FastAPI:
    gateway = Gateway(settings)
    results = AsyncRolloutClient(settings.redis_url, settings.namespace, consumer="gateway")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.close()
            await results.close()

    app = FastAPI(title="rollout-broker session gateway", lifespan=lifespan)
    app.state.gateway = gateway

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        where = _field(err.get("loc", ()))
        return _error(GatewayError(400, f"{where}: {err.get('msg', 'invalid')}", param=where))

    @app.exception_handler(RedisError)
    async def redis_error(request: Request, exc: RedisError) -> JSONResponse:
        if not is_outage(exc):
            raise exc
        return _error(GatewayError(503, f"redis: {type(exc).__name__}", code="redis_unavailable",
                                   retry_after_s=settings.retry_after_s))

    @app.exception_handler(ValueError)
    async def value_error(request: Request, exc: ValueError) -> JSONResponse:
        field, _, reason = str(exc).partition(": ")
        return _error(GatewayError(400, str(exc), param=field if reason else None))

    @app.post("/sessions/{episode_id}/v1/chat/completions", response_model=None)
    async def chat_completions(episode_id: str, req: ChatCompletionRequest) -> Any:
        if req.logprobs:
            raise GatewayError(400, "logprobs: the agent gets no logprobs; the trainer gets "
                               "every token's in the episode's result", param="logprobs")
        if req.tool_choice not in (None, "auto", "none") and not req.tools:
            raise GatewayError(400, "tool_choice: needs `tools`", param="tool_choice")
        call = ChatCall(
            messages=[m.model_dump(exclude_none=True) for m in req.messages],
            tools=req.tools, tool_choice=req.tool_choice or "auto",
            max_tokens=req.max_completion_tokens or req.max_tokens, model=req.model)
        reply, timing = await gateway.chat(episode_id, call)
        return _respond(reply, timing, req.stream, req.stream_options, "chat.completion.chunk",
                        _chat_chunks)

    @app.post("/sessions/{episode_id}/v1/completions", response_model=None)
    async def completions(episode_id: str, req: CompletionRequest) -> Any:
        reply, timing = await gateway.complete(episode_id, CompletionCall(
            prompt=req.prompt, max_tokens=req.max_tokens, model=req.model))
        return _respond(reply, timing, req.stream, req.stream_options, "text_completion",
                        _completion_chunks)

    @app.get("/sessions/{episode_id}/v1/models")
    async def models(episode_id: str) -> dict[str, Any]:
        await gateway.spec(episode_id)
        served = gateway.served_models() or ["rollout-broker"]
        return {"object": "list", "data": [{"id": m, "object": "model", "created": 0,
                                             "owned_by": "rollout-broker"} for m in served]}

    def trainer_only(request: Request) -> None:
        """The trainer's endpoints need the bearer token when the gateway has one; the agents'
        calls do not (an episode's id is its capability: open episodes with ids nobody can
        guess)."""
        if settings.token is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {settings.token}".encode()):
            raise GatewayError(401, "authorization: a bearer token is required",
                               param="authorization", code="unauthorized")

    @app.post("/v1/episodes", response_model=EpisodeOpenReply)
    async def open_episode(body: dict[str, Any], request: Request) -> EpisodeOpenReply:
        trainer_only(request)
        url = await results.open_episode(body, public_url)
        return EpisodeOpenReply(episode_id=str(body.get("session_id")), base_url=url)

    @app.post("/v1/episodes/{episode_id}/close", response_model=EpisodeCloseReply)
    async def close_episode(episode_id: str, body: EpisodeClose,
                            request: Request) -> EpisodeCloseReply:
        trainer_only(request)
        if body.reward is not None and body.reward_name is not None:
            raise GatewayError(400, "reward_name: give a reward or a reward_name, not both",
                               param="reward_name")
        reward = body.reward
        if body.reward_name is not None:
            reward = await gateway.score(episode_id, body.reward_name)
        outcome = await results.close_episode(episode_id, reward)
        if outcome == "unknown":
            raise GatewayError(404, f"episode {episode_id!r} is not open", code="episode_not_found")
        return EpisodeCloseReply(episode_id=episode_id, outcome=outcome, reward=reward)

    @app.get("/v1/results")
    async def read_results(request: Request, count: int = 64, timeout: float = 10.0,
                           by_group: bool = False) -> dict[str, Any]:
        """Up to `count` finished results, waiting up to `timeout` s; asking again acknowledges
        the batch before (as `RolloutClient.results` does)."""
        trainer_only(request)
        if not 1 <= count <= 4096:
            raise GatewayError(400, "count: must be 1-4096", param="count")
        if not 0 <= timeout <= 60:
            raise GatewayError(400, "timeout: must be 0-60 seconds", param="timeout")
        batch = await results.results(count, timeout=timeout, by_group=by_group)
        return {"results": [r.model_dump(mode="json") for r in batch]}

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True, "calls": gateway.calls}

    return app


def _respond(reply: dict[str, Any], timing: CallTiming, stream: bool,
             stream_options: dict[str, Any] | None, object_name: str,
             choices: Callable[[dict[str, Any]], list[dict[str, Any]]]) -> Response:
    """A call's reply, whole or as OpenAI's chunk stream (`object_name` chunks, one per choice
    `choices` makes of the reply, the usage when asked, then `[DONE]`). The gateway streams a
    call once its generation has finished: the first chunk comes when the reply is whole."""
    headers = {"Server-Timing": timing.header()}
    if not stream:
        return JSONResponse(reply, headers=headers)
    base = {"id": reply["id"], "object": object_name, "created": reply["created"],
            "model": reply["model"]}
    usage = bool((stream_options or {}).get("include_usage"))

    async def events() -> AsyncIterator[bytes]:
        for choice in choices(reply):
            yield _event({**base, "choices": [choice]})
        if usage:
            yield _event({**base, "choices": [], "usage": reply["usage"]})
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


def _event(body: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


def _chat_chunks(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """The role, the content, each tool call, then the finish reason."""
    choice = reply["choices"][0]
    message = choice["message"]
    deltas = [{"role": "assistant", "content": ""}]
    if message.get("content"):
        deltas.append({"content": message["content"]})
    deltas += [{"tool_calls": [{"index": i, **tc}]}
               for i, tc in enumerate(message.get("tool_calls") or ())]
    deltas.append({})
    return [{"index": 0, "delta": d, "logprobs": None,
             "finish_reason": choice["finish_reason"] if i == len(deltas) - 1 else None}
            for i, d in enumerate(deltas)]


def _completion_chunks(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """The text, then the finish reason."""
    choice = reply["choices"][0]
    return [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            for text, finish in ((choice["text"], None), ("", choice["finish_reason"]))]


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8100) -> None:
    """Run the gateway (`create_app`) in the foreground until interrupted."""
    import uvicorn
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)

