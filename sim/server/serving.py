"""Run a validated generation request on the engine and shape vLLM's responses.

A request with P prompts and `n` samples becomes P·n engine requests (ids `{id}-{p}-{i}`; sample i
gets `seed + i`, as vLLM's parallel sampling seeds its children). Choice index = p·n + i, usage
counts each prompt once and every sample's tokens, `cached_tokens` sums the first sample of each
prompt — the same bookkeeping vLLM's OpenAIServingCompletion does.

Chat replies to requests with tools are read as vLLM reads them when it is started with
`--enable-auto-tool-choice --tool-call-parser hermes` (`chat_reply`).
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from itertools import accumulate

from starlette.requests import Request

from broker.tool_calls import parse_tool_calls
from sim.engine.request import EngineRequest, StopScan
from sim.engine.sampling import top_alternatives
from sim.server.driver import EngineDriver
from sim.server.errors import ApiError
from sim.server.prompts import (
    Prompt,
    forced_tool_call,
    requested_logprobs,
    stop_strings,
    tool_choice,
)
from sim.server.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    GenerateChoice,
    GenerateLogProb,
    GenerateLogProbs,
    GenerateLogProbsContent,
    GenerateResponse,
    InferenceGenerateRequest,
    PromptTokenUsageInfo,
    SamplingFields,
    ToolCall,
    UsageInfo,
    WeightVersionSpan,
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


def stop_string_scan(tok: SimTokenizer, stops: list[str]) -> StopScan | None:
    """Where the output first contains one of `stops`, in output tokens up to and including
    the one that completes it (vLLM checks stop strings on the detokenized text as it grows,
    not before `min_tokens` tokens)."""
    if not stops:
        return None

    def scan(ids: list[int], min_tokens: int) -> tuple[int, int | str] | None:
        pieces = tok.pieces(ids)
        ends = list(accumulate(len(p) for p in pieces))
        text = "".join(pieces)
        best: tuple[int, int | str] | None = None
        for stop in stops:
            at = text.find(stop)
            while at != -1:
                tokens = bisect_left(ends, at + len(stop)) + 1
                if tokens >= min_tokens:
                    if best is None or tokens < best[0]:
                        best = (tokens, stop)
                    break
                at = text.find(stop, at + 1)
        return best

    return scan


def start_generation(driver: EngineDriver, request_id: str, model: str, prompts: list[Prompt],
                     max_tokens: list[int], req: SamplingFields,
                     tok: SimTokenizer, lora_seed: int = 0, priority: int = 0) -> Generation:
    gen = Generation(request_id=request_id, model=model, prompts=prompts, n=req.n, requests=[])
    scan = stop_string_scan(tok, stop_strings(req))
    stop_ids = frozenset(req.stop_token_ids or ())
    for p, prompt in enumerate(prompts):
        ending = forced_tool_call(req, prompt, tok)
        for i in range(req.n):
            gen.requests.append(EngineRequest(
                request_id=f"{request_id}-{p}-{i}",
                prompt_token_ids=list(prompt.token_ids),
                max_tokens=max_tokens[p],
                output_len=req.sim_output_len,
                ignore_eos=req.ignore_eos,
                seed=None if req.seed is None else req.seed + i,
                min_tokens=req.min_tokens,
                stop_token_ids=stop_ids,
                stop_scan=scan,
                forced_ending=ending,
                lora_seed=lora_seed,
                priority=priority,
            ))
    try:
        for r in gen.requests:
            gen.futures.append(driver.submit(r))
    except ValueError as exc:
        abort(driver, gen)
        raise ApiError.from_engine(exc) from exc
    return gen


def abort(driver: EngineDriver, gen: Generation) -> None:
    """Abort what the engine has not finished (a future cancelled with its waiter is done,
    but its request may still run)."""
    for r in gen.requests[:len(gen.futures)]:
        if not r.finished:
            driver.abort(r.request_id)


async def wait_all(driver: EngineDriver, gen: Generation) -> None:
    try:
        await asyncio.gather(*gen.futures)
    except asyncio.CancelledError:
        abort(driver, gen)
        raise


async def wait_all_or_disconnect(request: Request, driver: EngineDriver, gen: Generation) -> bool:
    """Wait for every engine request, unless the HTTP client goes away first: then abort them
    (vLLM aborts the requests of a dropped connection) and return False."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(wait_all(driver, gen))
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work.done():
        work.result()
        return True
    work.cancel()
    abort(driver, gen)
    return False


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


def _text(tok: SimTokenizer, r: EngineRequest, req: SamplingFields) -> str:
    """The output text; a stop string or the EOS that ended it is cut off (with what follows a
    stop string), unless `include_stop_str_in_output` (vLLM's detokenizer does the same)."""
    ids = r.output_token_ids
    if r.ends_with_eos and not req.include_stop_str_in_output:
        ids = ids[:-1]
    text = tok.decode(ids, skip_special_tokens=req.skip_special_tokens)
    if isinstance(r.stop_reason, str) and not req.include_stop_str_in_output:
        at = text.rfind(r.stop_reason)
        if at != -1:
            text = text[:at]
    return text


def _reason(r: EngineRequest) -> str | None:
    return None if r.finish_reason is None else str(r.finish_reason)


def _token_str(tok: SimTokenizer, token_id: int, req: SamplingFields) -> str:
    return f"token_id:{token_id}" if req.return_tokens_as_token_ids else tok.piece(token_id)


def _alternatives(tok: SimTokenizer, r: EngineRequest, k: int
                  ) -> list[list[tuple[int, float]]]:
    """Per output position: (token id, logprob) of the sampled token, then its k most likely
    alternatives."""
    out = []
    for pos, (tid, lp) in enumerate(zip(r.output_token_ids, r.output_logprobs)):
        alts = top_alternatives(r.token_seed, pos, tid, lp, k, tok.vocab_size)
        out.append([(tid, lp), *alts])
    return out


def completion_logprobs(tok: SimTokenizer, r: EngineRequest, k: int, req: SamplingFields,
                        offset: int) -> CompletionLogProbs:
    """vLLM's completions `logprobs` object: the sampled tokens, their logprobs, their text
    offsets (after the echoed prompt's, when echoing) and per position a dict of the sampled
    token and its k most likely alternatives."""
    ids, lps = r.output_token_ids, r.output_logprobs
    pieces = tok.pieces(ids)
    names = [f"token_id:{t}" for t in ids] if req.return_tokens_as_token_ids else pieces
    if k:
        top = [{_token_str(tok, t, req): v for t, v in step} for step in _alternatives(tok, r, k)]
    else:  # the sampled token alone (a reply this long is built on the server's event loop)
        top = [{name: lp} for name, lp in zip(names, lps)]
    return CompletionLogProbs.model_construct(  # our own values: nothing to validate
        text_offset=list(accumulate(map(len, pieces), initial=offset))[:-1],
        token_logprobs=list(lps), tokens=list(names), top_logprobs=top)


def chat_logprobs(tok: SimTokenizer, r: EngineRequest, k: int,
                  req: SamplingFields) -> ChatCompletionLogProbs:
    """vLLM's chat `logprobs`: one entry per sampled token, with its `top_logprobs` alternatives
    (k of them, the sampled token first when it is among them, as vLLM lists the top k)."""
    content = []
    for step in _alternatives(tok, r, k):
        tid, lp = step[0]
        ranked = sorted(step, key=lambda e: -e[1])[:k]
        content.append(ChatCompletionLogProbsContent(
            token=_token_str(tok, tid, req), logprob=lp,
            bytes=list(tok.piece(tid).encode("utf-8")),
            top_logprobs=[ChatCompletionLogProb(token=_token_str(tok, t, req), logprob=v,
                                                bytes=list(tok.piece(t).encode("utf-8")))
                          for t, v in ranked]))
    return ChatCompletionLogProbs(content=content)


def completion_choice(gen: Generation, index: int, tok: SimTokenizer, req: SamplingFields,
                      echo: bool) -> CompletionResponseChoice:
    r = gen.requests[index]
    prompt = gen.prompts[index // gen.n]
    text = _text(tok, r, req)
    prefix = ""
    if echo:
        prefix = prompt.text if prompt.text is not None else tok.decode(prompt.token_ids)
    want_ids = bool(req.return_token_ids)
    k = requested_logprobs(req)[0]
    return CompletionResponseChoice(
        index=index, text=prefix + text, finish_reason=_reason(r), stop_reason=r.stop_reason,
        logprobs=None if k is None else completion_logprobs(tok, r, k, req, len(prefix)),
        token_ids=list(r.output_token_ids) if want_ids else None,
        prompt_token_ids=list(prompt.token_ids) if want_ids else None)


def completion_response(gen: Generation, tok: SimTokenizer, req: SamplingFields,
                        echo: bool) -> CompletionResponse:
    choices = [completion_choice(gen, i, tok, req, echo) for i in range(len(gen.requests))]
    return CompletionResponse(id=gen.request_id, created=gen.created, model=gen.model,
                              choices=choices, usage=gen.usage())


@dataclass(frozen=True, slots=True)
class ChatReply:
    """One choice's reply: its text, the calls read from it, the finish reason to report."""

    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None


def chat_reply(req: SamplingFields, text: str, finish_reason: str | None,
               streaming: bool) -> ChatReply:
    """vLLM's reading of a chat reply with the hermes parser. With tools and a tool_choice
    other than "none" the text is parsed (`parse_tool_calls`). Calls found report "tool_calls"
    as the finish reason, except for a named tool_choice ("stop" then, as in OpenAI's API) and,
    when streaming, for a reply that did not end by stopping (vLLM streams "length" then);
    named and "required" choices report content "" rather than None. The sim reads every choice
    from hermes text: real vLLM constrains "required" and named choices to JSON instead."""
    choice = tool_choice(req) if isinstance(req, ChatCompletionRequest) else "none"
    if choice == "none":
        return ChatReply(text, [], finish_reason)
    parsed = parse_tool_calls(text)
    calls = [ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments))
             for c in parsed.calls]
    named = isinstance(choice, ChatCompletionNamedToolChoiceParam)
    content = parsed.content if choice == "auto" else parsed.content or ""
    if calls and not named and (finish_reason == "stop" or not streaming):
        finish_reason = "tool_calls"
    return ChatReply(content, calls, finish_reason)


def chat_response(gen: Generation, tok: SimTokenizer, req: SamplingFields) -> ChatCompletionResponse:
    want_ids = bool(req.return_token_ids)
    k = requested_logprobs(req)[0]
    choices = []
    for i, r in enumerate(gen.requests):
        reply = chat_reply(req, _text(tok, r, req), _reason(r), streaming=False)
        choices.append(ChatCompletionResponseChoice(
            index=i, message=ChatMessage(role="assistant", content=reply.content,
                                         tool_calls=reply.tool_calls),
            finish_reason=reply.finish_reason, stop_reason=r.stop_reason,
            logprobs=None if k is None else chat_logprobs(tok, r, k, req),
            token_ids=list(r.output_token_ids) if want_ids else None))
    return ChatCompletionResponse(id=gen.request_id, created=gen.created, model=gen.model,
                                  choices=choices, usage=gen.usage(),
                                  prompt_token_ids=gen.prompts[0].token_ids if want_ids else None)


def weight_version_spans(r: EngineRequest) -> list[WeightVersionSpan] | None:
    """Which weights label generated which output tokens (vLLM's `weight_versions`)."""
    starts = r.weight_version_starts
    if starts is None:
        return None
    ends = [start for _, start in starts[1:]] + [r.num_output_tokens]
    return [WeightVersionSpan(version=v, start=s, end=e)
            for (v, s), e in zip(starts, ends) if e > s]


def generate_logprobs(tok: SimTokenizer, r: EngineRequest, k: int) -> GenerateLogProbs:
    """`/inference/v1/generate`'s token-id logprobs: per position the sampled token, then its
    top k (the sampled token first, as vLLM lists them)."""
    if k == 0:  # the sampled token alone: built without validation (a long reply's hot path)
        sampled = GenerateLogProb.model_construct
        content = [GenerateLogProbsContent.model_construct(
            token_id=t, logprob=lp, rank=None, top_logprobs=[sampled(token_id=t, logprob=lp,
                                                                      rank=None)])
            for t, lp in zip(r.output_token_ids, r.output_logprobs)]
        return GenerateLogProbs.model_construct(content=content)
    content = []
    for step in _alternatives(tok, r, k):
        tid, lp = step[0]
        ranked = sorted(step, key=lambda e: -e[1])
        top = [GenerateLogProb(token_id=tid, logprob=lp)]
        top += [GenerateLogProb(token_id=t, logprob=v) for t, v in ranked[:k] if t != tid]
        content.append(GenerateLogProbsContent(token_id=tid, logprob=lp, top_logprobs=top))
    return GenerateLogProbs(content=content)


def generate_response(gen: Generation, tok: SimTokenizer,
                      req: InferenceGenerateRequest) -> GenerateResponse:
    sp = req.sampling_params
    text_mode = req.output_mode == "text"
    k = sp.logprobs
    choices = []
    for i, r in enumerate(gen.requests):
        logprobs = None
        if k is not None:
            logprobs = chat_logprobs(tok, r, k, sp) if text_mode else generate_logprobs(tok, r, k)
        choices.append(GenerateChoice(
            index=i, finish_reason=_reason(r), stop_reason=r.stop_reason,
            token_ids=list(r.output_token_ids), weight_versions=weight_version_spans(r),
            text=_text(tok, r, sp) if text_mode else None, logprobs=logprobs))
    return GenerateResponse(request_id=gen.request_id, model=gen.model, created=gen.created,
                            usage=gen.usage(), output_mode=req.output_mode, choices=choices,
                            prompt_token_ids=gen.prompts[0].token_ids if req.return_token_ids
                            else None)


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


def _reply_deltas(reply: ChatReply) -> list[DeltaMessage]:
    """A finished choice's deltas: its whole text in one; with calls, the text before them
    (if any), every call whole in one more, then an empty one to carry the finish reason."""
    if not reply.tool_calls:
        return [DeltaMessage(content=reply.content)]
    calls = [DeltaToolCall(index=j, id=c.id, type="function",
                           function=DeltaFunctionCall(name=c.function.name,
                                                      arguments=c.function.arguments))
             for j, c in enumerate(reply.tool_calls)]
    deltas = [DeltaMessage(content=reply.content)] if reply.content else []
    return [*deltas, DeltaMessage(tool_calls=calls), DeltaMessage()]


async def chat_stream(driver: EngineDriver, gen: Generation, tok: SimTokenizer,
                      req: SamplingFields) -> AsyncIterator[str]:
    """A role chunk per choice first (as vLLM does), then as each finishes its deltas
    (`_reply_deltas`): its logprobs and token ids ride on the first, its finish on the last."""
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
        k = requested_logprobs(req)[0]
        reply = chat_reply(req, _text(tok, r, req), _reason(r), streaming=True)
        deltas = _reply_deltas(reply)
        for j, delta in enumerate(deltas):
            first, last = j == 0, j == len(deltas) - 1
            yield chunk(ChatCompletionStreamChoice(
                index=i, delta=delta,
                finish_reason=reply.finish_reason if last else None,
                stop_reason=r.stop_reason if last else None,
                logprobs=None if k is None or not first else chat_logprobs(tok, r, k, req),
                token_ids=list(r.output_token_ids) if want_ids and first else None), False)
    if _include_usage(req):
        usage = ChatCompletionStreamResponse(id=gen.request_id, created=gen.created,
                                             model=gen.model, choices=[], usage=gen.usage())
        yield _sse(usage.model_dump_json())
    yield _sse("[DONE]")
