"""Turn HTTP requests into engine inputs: prompt token ids, max_tokens and sampling params.

Validation here mirrors vLLM's serving layer (messages and `param` names as vLLM gives them), so a
request that real vLLM rejects with a 400 is rejected here with the same field named.

`sim_tool_call` becomes the engine request's forced ending: the tokens of a hermes call of the
request's tool (`forced_tool_call`), then EOS, with arguments drawn from the request's seed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from broker.tool_calls import arguments_for, render_tool_call
from sim.engine.request import ForcedEnding
from sim.server.errors import ApiError
from sim.server.protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
    ChatCompletionToolsParam,
    ChatMessageParam,
    CompletionRequest,
    GenerateSamplingParams,
    InferenceGenerateRequest,
    SamplingFields,
    ToolChoice,
)
from sim.server.tokenizer import ChatMessage, MessageToolCall, SimTokenizer, tools_in_prompt


@dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # the prompt as text, when the client sent text (for `echo`)


def completion_prompts(req: CompletionRequest, tok: SimTokenizer) -> list[Prompt]:
    """vLLM's four prompt forms: a string, a list of strings, token ids, a list of token-id lists."""
    p = req.prompt
    if p is None or p == "" or p == []:
        raise ApiError("Either prompt or prompt_embeds must be provided and non-empty.",
                       param="prompt")
    if isinstance(p, str):
        return [Prompt(tok.encode(p), p)]
    if all(isinstance(x, int) for x in p):
        return [Prompt(list(p), None)]  # type: ignore[arg-type]
    prompts = [Prompt(tok.encode(x), x) if isinstance(x, str) else Prompt(list(x), None)
               for x in p]
    if any(not pr.token_ids for pr in prompts):
        raise ApiError("Either prompt or prompt_embeds must be provided and non-empty.",
                       param="prompt")
    return prompts


def _content_text(m: ChatMessageParam) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    return "".join(str(part.get("text", "")) for part in m.content if part.get("type") == "text")


def _call_arguments(arguments: str | dict[str, Any] | None, field: str) -> dict[str, Any]:
    """An earlier call's arguments as the template renders them: vLLM decodes the JSON text
    first (empty means no arguments)."""
    if not arguments:
        return {}
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise ApiError(f"{field}: not valid JSON ({exc})", param="messages") from exc


def _template_message(m: ChatMessageParam, index: int) -> ChatMessage:
    calls = tuple(
        MessageToolCall(c.function.name, _call_arguments(
            c.function.arguments, f"messages.{index}.tool_calls.{j}.function.arguments"))
        for j, c in enumerate(m.tool_calls or ()))
    return ChatMessage(m.role, _content_text(m), calls)


def tool_dicts(tools: list[ChatCompletionToolsParam] | None) -> list[dict[str, Any]] | None:
    """The tools as the chat template lists them: the fields the client gave."""
    return None if tools is None else [t.model_dump(exclude_none=True) for t in tools]


def chat_prompt(messages: list[ChatMessageParam], add_generation_prompt: bool,
                continue_final_message: bool, tok: SimTokenizer,
                tools: list[ChatCompletionToolsParam] | None = None) -> Prompt:
    if not messages:
        raise ApiError("messages: must contain at least one message.", param="messages")
    if add_generation_prompt and continue_final_message:
        raise ApiError("Cannot set both `continue_final_message` and `add_generation_prompt` "
                       "to True.", param="continue_final_message")
    text = tok.apply_chat_template([_template_message(m, i) for i, m in enumerate(messages)],
                                   add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message,
                                   tools=tool_dicts(tools))
    return Prompt(tok.encode(text), text)


_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def check_tool_choice(tools: list[ChatCompletionToolsParam] | None,
                      tool_choice: ToolChoice) -> None:
    """vLLM's checks of `tool_choice` against `tools` (its messages, the field named)."""
    if tool_choice is None or tool_choice == "none":
        return
    if tools is None:
        raise ApiError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "required"):
            raise ApiError(f"Invalid value for `tool_choice`: {tool_choice}! Only named tools, "
                           '"none", "auto" or "required" are supported.', param="tool_choice")
        return
    if not tool_choice.function.name:
        raise ApiError(f"Invalid `name` in `function`: `{tool_choice.function.name}` in "
                       f"`tool_choice`! {_NAMED_USAGE}", param="tool_choice")
    if all(t.function.name != tool_choice.function.name for t in tools):
        raise ApiError("The tool specified in `tool_choice` does not match any of the specified "
                       "`tools`", param="tool_choice")


def tool_choice(req: ChatCompletionRequest) -> str | ChatCompletionNamedToolChoiceParam:
    """The choice vLLM acts on: "auto" when tools come without one; "none" without tools (an
    empty list included, where "required" falls back to "none" as in OpenAI's API)."""
    if not req.tools:
        return "none"
    return "auto" if req.tool_choice is None else req.tool_choice


def forced_tool_call(req: SamplingFields, prompt: Prompt, tok: SimTokenizer
                     ) -> ForcedEnding | None:
    """What `sim_tool_call` makes the output end with: the tokens of a call of the chat
    request's named `tool_choice` or first tool — for a prompt of text or token ids, of the
    first tool of its last tools block — then EOS; arguments valid for the function's
    parameters, drawn from the request's token seed. None without the hint or a tool."""
    if not req.sim_tool_call:
        return None
    if isinstance(req, ChatCompletionRequest):
        functions = [t.function.model_dump() for t in req.tools or ()]
        if isinstance(req.tool_choice, ChatCompletionNamedToolChoiceParam):
            functions = [f for f in functions if f["name"] == req.tool_choice.function.name]
    else:
        text = prompt.text if prompt.text is not None else tok.decode(prompt.token_ids)
        functions = [t.get("function", t) for t in tools_in_prompt(text)]
    if not functions or not isinstance(functions[0].get("name"), str):
        return None
    name, parameters = functions[0]["name"], functions[0].get("parameters")

    def ending(token_seed: int) -> list[int]:
        call = render_tool_call(name, arguments_for(parameters, random.Random(token_seed)))
        return tok.encode(call) + [tok.eos_token_id]

    return ending


MAX_LOGPROBS = 20  # vLLM's default `--max-logprobs`


def check_sampling(req: SamplingFields) -> None:
    """vLLM's SamplingParams checks, with the field named."""
    if req.n < 1:
        raise ApiError(f"n must be at least 1, got {req.n}.", param="n")
    if req.sim_output_len is not None and req.sim_output_len < 1:
        raise ApiError(f"sim_output_len must be at least 1, got {req.sim_output_len}.",
                       param="sim_output_len")
    if req.top_k is not None and req.top_k < -1:
        raise ApiError(f"top_k must be 0 or -1 (disable), or at least 1, got {req.top_k}.",
                       param="top_k")
    if req.min_p is not None and not 0.0 <= req.min_p <= 1.0:
        raise ApiError(f"min_p must be in [0, 1], got {req.min_p}.", param="min_p")
    if req.repetition_penalty is not None and req.repetition_penalty <= 0.0:
        raise ApiError("repetition_penalty must be greater than zero, got "
                       f"{req.repetition_penalty}.", param="repetition_penalty")
    if req.min_tokens < 0:
        raise ApiError(f"min_tokens must be greater than or equal to 0, got {req.min_tokens}.",
                       param="min_tokens")
    if "" in stop_strings(req):
        raise ApiError("stop cannot contain an empty string.", param="stop")
    if any(t < 0 for t in req.stop_token_ids or ()):
        raise ApiError("stop_token_ids must be non-negative token ids.", param="stop_token_ids")
    wanted, field = requested_logprobs(req)
    if wanted is not None and wanted < 0:
        raise ApiError(f"{field} must be a non-negative value, got {wanted}.", param=field)
    if wanted is not None and wanted > MAX_LOGPROBS:
        raise ApiError(f"Requested sample logprobs of {wanted}, which is greater than max "
                       f"allowed: {MAX_LOGPROBS}", param=field)


def stop_strings(req: SamplingFields) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def requested_logprobs(req: SamplingFields) -> tuple[int | None, str]:
    """How many alternatives per token the request wants besides the sampled token's logprob
    (None: no logprobs), and the field that asks: completions' `logprobs: k`, chat's
    `logprobs: true` with `top_logprobs: k`."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None, "top_logprobs"
    return getattr(req, "logprobs", None), "logprobs"


def check_token_ids(prompt: Prompt, vocab_size: int, field: str) -> None:
    if prompt.token_ids and max(prompt.token_ids) >= vocab_size:
        raise ApiError(f"Token id {max(prompt.token_ids)} is out of vocabulary", param=field)


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int,
                       field: str, input_field: str) -> int:
    """vLLM's context-length check (its wording says "messages" for both endpoints);
    `requested=None` means "the rest of the context"."""
    if prompt_len >= max_model_len:
        raise ApiError(f"This model's maximum context length is {max_model_len} tokens. However, "
                       f"your request has {prompt_len} input tokens. Please reduce the length of "
                       "the input messages.", param=input_field)
    if requested is None:
        return max_model_len - prompt_len
    if requested < 1:
        raise ApiError(f"{field} must be at least 1, got {requested}.", param=field)
    if prompt_len + requested > max_model_len:
        raise ApiError(f"This model's maximum context length is {max_model_len} tokens. However, "
                       f"you requested {prompt_len + requested} tokens ({prompt_len} in the "
                       f"messages, {requested} in the completion). Please reduce the length of "
                       "the messages or completion.", param=field)
    return requested


def completion_inputs(req: CompletionRequest, tok: SimTokenizer, vocab_size: int,
                      max_model_len: int) -> tuple[list[Prompt], list[int]]:
    """Validated prompts of a completion request and each one's max_tokens."""
    check_sampling(req)
    prompts = completion_prompts(req, tok)
    limits = []
    for pr in prompts:
        check_token_ids(pr, vocab_size, "prompt")
        limits.append(resolve_max_tokens(req.max_tokens, len(pr.token_ids), max_model_len,
                                         "max_tokens", "prompt"))
    return prompts, limits


def generate_inputs(req: InferenceGenerateRequest, vocab_size: int, max_model_len: int
                    ) -> tuple[Prompt, int, GenerateSamplingParams]:
    """The validated prompt of a `/inference/v1/generate` request, its max_tokens and its
    sampling params (errors name fields as vLLM does: `sampling_params.max_tokens`)."""
    sp = req.sampling_params
    extra = sp.extra_args or {}
    if "sim_output_len" in extra:
        sp = sp.model_copy(update={"sim_output_len": int(extra["sim_output_len"])})
    if "sim_tool_call" in extra:
        if not isinstance(extra["sim_tool_call"], bool):
            raise ApiError("sim_tool_call must be true or false, got "
                           f"{extra['sim_tool_call']!r}.",
                           param="sampling_params.extra_args.sim_tool_call")
        sp = sp.model_copy(update={"sim_tool_call": extra["sim_tool_call"]})
    try:
        check_sampling(sp)
    except ApiError as exc:
        exc.param = f"sampling_params.{exc.param}" if exc.param else "sampling_params"
        raise
    if req.stream:
        raise ApiError("the simulator's /inference/v1/generate answers whole replies only",
                       param="stream")
    if req.output_mode == "text" and not sp.detokenize:
        raise ApiError("output_mode='text' requires sampling_params.detokenize to be true",
                       param="output_mode")
    prompt = Prompt(list(req.token_ids), None)
    check_token_ids(prompt, vocab_size, "token_ids")
    n = len(prompt.token_ids)
    if n > max_model_len:  # vLLM's wording; unlike completions, a long max_tokens is clipped
        raise ApiError(f"The decoder prompt (length {n}) is longer than the maximum model length "
                       f"of {max_model_len}. Make sure that `max_model_len` is no smaller than "
                       "the number of text tokens.", param="token_ids")
    if n == max_model_len:
        raise ApiError(f"The decoder prompt (length {n}) plus the number of requested output "
                       f"tokens (at least 1) is longer than the maximum model length of "
                       f"{max_model_len}.", param="token_ids")
    if sp.max_tokens is not None and sp.max_tokens < 1:
        raise ApiError(f"max_tokens must be at least 1, got {sp.max_tokens}.",
                       param="sampling_params.max_tokens")
    room = max_model_len - n
    return prompt, room if sp.max_tokens is None else min(sp.max_tokens, room), sp


def chat_inputs(req: ChatCompletionRequest, tok: SimTokenizer,
                max_model_len: int) -> tuple[Prompt, int]:
    """The validated rendered prompt of a chat request and its max_tokens."""
    check_sampling(req)
    check_tool_choice(req.tools, req.tool_choice)
    prompt = chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message,
                         tok, req.tools)
    requested, field = chat_max_tokens(req)
    return prompt, resolve_max_tokens(requested, len(prompt.token_ids), max_model_len, field,
                                      "messages")


def chat_max_tokens(req: ChatCompletionRequest) -> tuple[int | None, str]:
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def sampling_params(req: SamplingFields, max_tokens: int) -> dict[str, Any]:
    """The subset of vLLM's SamplingParams the render endpoints echo back."""
    return {
        "n": req.n,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": 0 if req.top_k is None else req.top_k,
        "min_p": 0.0 if req.min_p is None else req.min_p,
        "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty,
        "seed": req.seed,
        "stop": stop_strings(req),
        "stop_token_ids": list(req.stop_token_ids or []),
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "logprobs": requested_logprobs(req)[0],
        "ignore_eos": req.ignore_eos,
        "max_tokens": max_tokens,
        "min_tokens": req.min_tokens,
        "skip_special_tokens": req.skip_special_tokens,
        "extra_args": _sim_extra_args(req),
    }


def _sim_extra_args(req: SamplingFields) -> dict[str, Any] | None:
    """The sim-only hints as `/inference/v1/generate` takes them, in `extra_args`."""
    extra: dict[str, Any] = {}
    if req.sim_output_len is not None:
        extra["sim_output_len"] = req.sim_output_len
    if req.sim_tool_call:
        extra["sim_tool_call"] = True
    return extra or None
