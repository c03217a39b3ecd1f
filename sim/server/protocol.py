"""vLLM's OpenAI-compatible request/response models, with vLLM's field names.

Shapes follow vLLM's `vllm/entrypoints/openai/{completion,chat_completion,engine}/protocol.py`
and `serve/disagg/protocol.py` (render). Requests accept unknown fields (vLLM logs and ignores
them), so clients written for real vLLM work unchanged. Stop conditions (`stop`,
`stop_token_ids`, `min_tokens`) end outputs as in vLLM and logprobs come back in vLLM's shapes;
the knobs that change no simulated token (temperature, top_p, top_k, min_p, repetition_penalty)
are validated and echoed where vLLM echoes them. Two extra fields steer the simulated output and
real vLLM ignores them: `sim_output_len` fixes its length, `sim_tool_call` makes it end with a
call of one of the request's tools (see `SamplingFields`). Chat requests carry OpenAI function
tools (`tools`, `tool_choice`, assistant `tool_calls`, `tool` messages) and replies carry
`tool_calls`, as vLLM's do with `--enable-auto-tool-choice --tool-call-parser hermes`.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from broker.tool_calls import tool_call_id


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# --- requests -----------------------------------------------------------------------------

TokenId = Annotated[int, Field(ge=0)]


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class SamplingFields(OpenAIBaseModel):
    """The sampling fields both generation endpoints share."""

    model: str | None = None
    n: int = 1
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    request_id: str | None = None
    priority: int = 0  # vLLM's: lower first, read only under --scheduling-policy priority
    sim_output_len: int | None = Field(
        default=None, description="Simulator only: stop after this many tokens (≤ max_tokens)."
    )
    sim_tool_call: bool = Field(
        default=False, description="Simulator only: end the output with a hermes tool call of "
        "the named tool_choice or the first tool (for prompts given as text or token ids: the "
        "first tool of the prompt's last <tools> block), then EOS. The output is as long as it "
        "would have been, or as the call and EOS if that is longer, up to max_tokens."
    )


class CompletionRequest(SamplingFields):
    prompt: list[TokenId] | list[list[TokenId]] | str | list[str] | None = None
    logprobs: int | None = None  # the sampled token's logprob plus this many alternatives
    max_tokens: int | None = 16
    echo: bool | None = False
    add_special_tokens: bool = True


class FunctionCallParam(OpenAIBaseModel):
    name: str
    arguments: str | dict[str, Any] | None = None  # JSON text, as OpenAI sends it (or decoded)


class ToolCallParam(OpenAIBaseModel):
    """A call an earlier assistant message made."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessageParam(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None  # None: an assistant that only calls
    tool_calls: list[ToolCallParam] | None = None  # role "assistant"
    tool_call_id: str | None = None  # role "tool": the call this answers
    name: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(OpenAIBaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    """`tool_choice` naming the function to call."""

    function: ChatCompletionNamedFunction
    type: Literal["function"] = "function"


# "none" | "auto" | "required" | a named function; None: "auto" with tools, else "none" (vLLM).
# A string is checked by the server, so a bad one gets vLLM's message.
ToolChoice = str | ChatCompletionNamedToolChoiceParam | None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageParam]
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: ToolChoice = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    logprobs: bool | None = False
    top_logprobs: int | None = 0


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: list[ChatMessageParam]
    tools: list[ChatCompletionToolsParam] | None = None  # listed as the chat template does
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[TokenId]


# --- responses ----------------------------------------------------------------------------


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    """A streamed piece of call number `index` (the sim streams each call whole)."""

    id: str | None = None
    type: Literal["function"] | None = None
    index: int
    function: DeltaFunctionCall | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class GenerateRequest(OpenAIBaseModel):
    """What the render endpoints return: a tokens-in request for `/inference/v1/generate`."""

    request_id: str
    token_ids: list[int]
    sampling_params: dict[str, Any]
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = 0
    token_offsets: list[tuple[int, int]] | None = None


class GenerateSamplingParams(SamplingFields):
    """`sampling_params` of vLLM's `/inference/v1/generate` (its SamplingParams' fields).
    `extra_args.sim_output_len` and `extra_args.sim_tool_call` steer a simulated output as the
    top-level fields do, written there by the render endpoints; real vLLM passes extra_args
    through to logits processors and ignores them."""

    max_tokens: int | None = 16
    logprobs: int | None = None
    detokenize: bool = True
    extra_args: dict[str, Any] | None = None


class InferenceGenerateRequest(OpenAIBaseModel):
    """vLLM's token-in, token-out `POST /inference/v1/generate` (`--enable-scale-out`)."""

    request_id: str | None = None
    token_ids: list[TokenId] = Field(min_length=1)
    sampling_params: GenerateSamplingParams
    model: str | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    stream: bool | None = False
    return_token_ids: bool | None = None
    priority: int = 0  # vLLM's: lower first, read only under --scheduling-policy priority


class GenerateLogProb(OpenAIBaseModel):
    token_id: int
    logprob: float
    rank: int | None = None


class GenerateLogProbsContent(GenerateLogProb):
    top_logprobs: list[GenerateLogProb] = Field(default_factory=list)


class GenerateLogProbs(OpenAIBaseModel):
    content: list[GenerateLogProbsContent] | None = None


class WeightVersionSpan(OpenAIBaseModel):
    """Output tokens [start, end) were sampled by the weights labelled `version`."""

    version: str
    start: int
    end: int


class GenerateChoice(OpenAIBaseModel):
    index: int
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    weight_versions: list[WeightVersionSpan] | None = None
    text: str | None = None  # output_mode "text" only
    logprobs: GenerateLogProbs | ChatCompletionLogProbs | None = None


class GenerateResponse(OpenAIBaseModel):
    request_id: str
    model: str | None = None
    created: int = Field(default_factory=lambda: int(time.time()))
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    choices: list[GenerateChoice]


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class ModelPermission(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"modelperm-{random_uuid()}")
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list)
    # Simulator only (vLLM's card has no such field): token ids must be below it. A worker
    # registers it so the broker can refuse out-of-vocabulary prompts at enqueue.
    vocab_size: int | None = None


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)
