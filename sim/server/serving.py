"""Run a validated generation request on the engine and shape vLLM's responses.

A request with P prompts and `n` samples becomes P·n engine requests (ids `{id}-{p}-{i}`; sample i
gets `seed + i`, as vLLM's parallel sampling seeds its children). Choice index = p·n + i, usage
counts each prompt once and every sample's tokens, `cached_tokens` sums the first sample of each
prompt — the same bookkeeping vLLM's OpenAIServingCompletion does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from sim.engine.request import EngineRequest
from sim.server.driver import EngineDriver
from sim.server.errors import ApiError
from sim.server.prompts import Prompt
from sim.server.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaMessage,
    PromptTokenUsageInfo,
    SamplingFields,
    UsageInfo,
)
from sim.server.tokenizer import SimTokenizer


@dataclass
class Generation:
    """The engine requests behind one HTTP request, in choice order."""

    request_id: str
    model: str
    prompts: list[Prompt]
    n: int
    requests: list[EngineRequest]
    futures: list[asyncio.Future[EngineRequest]] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))

    def usage(self) -> UsageInfo:
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        completion = sum(r.num_output_tokens for r in self.requests)
        cached = sum(self.requests[i * self.n].num_cached_tokens for i in range(len(self.prompts)))
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                         total_tokens=prompt_tokens + completion,
                         prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached))


def start_generation(driver: EngineDriver, request_id: str, model: str, prompts: list[Prompt],
                     max_tokens: list[int], req: SamplingFields) -> Generation:
    gen = Generation(request_id=request_id, model=model, prompts=prompts, n=req.n, requests=[])
    for p, prompt in enumerate(prompts):
        for i in range(req.n):
            gen.requests.append(EngineRequest(
                request_id=f"{request_id}-{p}-{i}",
                prompt_token_ids=list(prompt.token_ids),
                max_tokens=max_tokens[p],
                output_len=req.sim_output_len,
                ignore_eos=req.ignore_eos,
                seed=None if req.seed is None else req.seed + i,
            ))
    try:
        for r in gen.requests:
            gen.futures.append(driver.submit(r))
    except ValueError as exc:
        abort(driver, gen)
        raise ApiError.from_engine(exc) from exc
    return gen


def abort(driver: EngineDriver, gen: Generation) -> None:
    for r, fut in zip(gen.requests, gen.futures):
        if not fut.done():
            driver.abort(r.request_id)


async def wait_all(driver: EngineDriver, gen: Generation) -> None:
    try:
        await asyncio.gather(*gen.futures)
    except asyncio.CancelledError:
        abort(driver, gen)
        raise


async def finished_in_order(driver: EngineDriver, gen: Generation) -> AsyncIterator[int]:
    """Yield choice indexes as their engine requests finish."""
    index_of = {id(f): i for i, f in enumerate(gen.futures)}
    pending: set[asyncio.Future[EngineRequest]] = set(gen.futures)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=lambda f: index_of[id(f)]):
                yield index_of[id(fut)]
    finally:
        abort(driver, gen)


def _text(tok: SimTokenizer, r: EngineRequest, skip_special: bool) -> str:
    return tok.decode(r.output_token_ids, skip_special_tokens=skip_special)


def _reason(r: EngineRequest) -> str | None:
    return None if r.finish_reason is None else str(r.finish_reason)


def completion_choice(gen: Generation, index: int, tok: SimTokenizer, req: SamplingFields,
                      echo: bool) -> CompletionResponseChoice:
    r = gen.requests[index]
    prompt = gen.prompts[index // gen.n]
    text = _text(tok, r, req.skip_special_tokens)
    if echo:
        text = (prompt.text if prompt.text is not None else tok.decode(prompt.token_ids)) + text
    want_ids = bool(req.return_token_ids)
    return CompletionResponseChoice(
        index=index, text=text, finish_reason=_reason(r),
        token_ids=list(r.output_token_ids) if want_ids else None,
        prompt_token_ids=list(prompt.token_ids) if want_ids else None)


def completion_response(gen: Generation, tok: SimTokenizer, req: SamplingFields,
                        echo: bool) -> CompletionResponse:
    choices = [completion_choice(gen, i, tok, req, echo) for i in range(len(gen.requests))]
    return CompletionResponse(id=gen.request_id, created=gen.created, model=gen.model,
                              choices=choices, usage=gen.usage())


def chat_response(gen: Generation, tok: SimTokenizer, req: SamplingFields) -> ChatCompletionResponse:
    want_ids = bool(req.return_token_ids)
    choices = [
        ChatCompletionResponseChoice(
            index=i, message=ChatMessage(role="assistant",
                                         content=_text(tok, r, req.skip_special_tokens)),
            finish_reason=_reason(r), token_ids=list(r.output_token_ids) if want_ids else None)
        for i, r in enumerate(gen.requests)
    ]
    return ChatCompletionResponse(id=gen.request_id, created=gen.created, model=gen.model,
                                  choices=choices, usage=gen.usage(),
                                  prompt_token_ids=gen.prompts[0].token_ids if want_ids else None)


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def _include_usage(req: SamplingFields) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


async def completion_stream(driver: EngineDriver, gen: Generation, tok: SimTokenizer,
                            req: SamplingFields, echo: bool) -> AsyncIterator[str]:
    """One chunk per choice, sent when that choice finishes (vLLM sends deltas as they decode)."""
    async for i in finished_in_order(driver, gen):
        chunk = CompletionStreamResponse(id=gen.request_id, created=gen.created, model=gen.model,
                                         choices=[completion_choice(gen, i, tok, req, echo)])
        yield _sse(chunk.model_dump_json())
    if _include_usage(req):
        final = CompletionStreamResponse(id=gen.request_id, created=gen.created, model=gen.model,
                                         choices=[], usage=gen.usage())
        yield _sse(final.model_dump_json())
    yield _sse("[DONE]")


async def chat_stream(driver: EngineDriver, gen: Generation, tok: SimTokenizer,
                      req: SamplingFields) -> AsyncIterator[str]:
    """A role chunk per choice first (as vLLM does), then one content chunk as each finishes."""
    want_ids = bool(req.return_token_ids)

    def chunk(choice: ChatCompletionStreamChoice, first: bool) -> str:
        body = ChatCompletionStreamResponse(
            id=gen.request_id, created=gen.created, model=gen.model, choices=[choice],
            prompt_token_ids=gen.prompts[0].token_ids if (want_ids and first) else None)
        return _sse(body.model_dump_json())

    for i in range(len(gen.requests)):
        yield chunk(ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                           content="")), i == 0)
    async for i in finished_in_order(driver, gen):
        r = gen.requests[i]
        yield chunk(ChatCompletionStreamChoice(
            index=i, delta=DeltaMessage(content=_text(tok, r, req.skip_special_tokens)),
            finish_reason=_reason(r),
            token_ids=list(r.output_token_ids) if want_ids else None), False)
    if _include_usage(req):
        usage = ChatCompletionStreamResponse(id=gen.request_id, created=gen.created,
                                             model=gen.model, choices=[], usage=gen.usage())
        yield _sse(usage.model_dump_json())
    yield _sse("[DONE]")
