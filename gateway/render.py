"""Chat messages to token ids, once per episode: the chat template is applied to new messages
only, never to the history again.

A call's prompt is the episode's token ids so far (every prompt and every output, exactly as
the engine consumed and produced them) plus the tokens of the call's new messages. Those are
found by rendering the new messages after a fixed two-message frame (a user message and an
assistant reply) and keeping what follows the frame's own rendering: the template's tokens for
those messages in that position (a tool response block, the next user turn, the generation
prompt). Between the model's last output and them go the tokens the template closes an
assistant message with, less the end-of-turn token the model generated itself (a ChatML model
stops on `<|im_end|>`; the template then adds a newline). Re-rendering the whole conversation
instead would re-tokenize the model's output, which need not give back the ids it sampled (the
retokenization drift verl and slime guard against).

Where the template comes from (`rollout-broker gateway --tokenizer`):
- `engine` (default): each backend's engine renders, through vLLM's `POST /tokenize` with
  `messages` and `tools`: always the served model's template, at the cost of a round trip to
  an engine that is busy generating;
- a Hugging Face tokenizer name or path: the gateway renders with `transformers`'
  `apply_chat_template`, as vLLM's `/tokenize` does with the same tokenizer files;
- `sim`: the simulated engines' tokenizer and template (sim/server), in the gateway.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from pydantic import ValidationError

from sim.server.errors import ApiError
from sim.server.prompts import chat_prompt
from sim.server.protocol import TokenizeChatRequest
from sim.server.tokenizer import SimTokenizer

_FRAME = [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "ok"}]


class RenderError(RuntimeError):
    """The template could not render the messages (the engine's 400 message, or the
    tokenizer's error), or it does not render a conversation as the prefix of a longer one."""


class TemplateSource(Protocol):
    async def render(self, messages: list[dict[str, Any]], tools: list[dict] | None,
                     generation_prompt: bool) -> list[int]: ...

    async def encode(self, text: str) -> list[int]: ...


class EngineTemplate:
    """One engine's `/tokenize` (vLLM's: chat form with `messages` and `tools`)."""

    def __init__(self, http: httpx.AsyncClient, url: str, model: str,
                 timeout_s: float = 30.0) -> None:
        self.http, self.url, self.model, self.timeout_s = http, url, model, timeout_s

    async def render(self, messages: list[dict[str, Any]], tools: list[dict] | None,
                     generation_prompt: bool) -> list[int]:
        body: dict[str, Any] = {"model": self.model, "messages": messages,
                                "add_generation_prompt": generation_prompt,
                                "add_special_tokens": False}
        if tools:
            body["tools"] = tools
        return await self._post(body)

    async def encode(self, text: str) -> list[int]:
        return await self._post({"model": self.model, "prompt": text, "add_special_tokens": False})

    async def _post(self, body: dict) -> list[int]:
        r = await self.http.post(f"{self.url}/tokenize", json=body, timeout=self.timeout_s)
        if r.status_code >= 500:
            r.raise_for_status()
        if r.status_code >= 400:
            try:
                message = r.json().get("error", {}).get("message") or r.text
            except ValueError:
                message = r.text
            raise RenderError(str(message)[:500])
        return [int(t) for t in r.json()["tokens"]]


class HfTemplate:
    """A Hugging Face tokenizer's chat template, in the gateway (`transformers`)."""

    def __init__(self, name_or_path: str) -> None:
        from transformers import AutoTokenizer  # only here: the gateway needs it for this

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        except Exception as exc:  # noqa: BLE001 - any failure to load is the option's
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ValueError(f"tokenizer: cannot load {name_or_path!r}: {first}") from None

    async def render(self, messages: list[dict[str, Any]], tools: list[dict] | None,
                     generation_prompt: bool) -> list[int]:
        try:
            out = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                                     return_dict=False,
                                                     add_generation_prompt=generation_prompt)
        except Exception as exc:  # jinja errors name the message; pass them on as a 400
            raise RenderError(str(exc)[:500]) from exc
        return [int(t) for t in out]

    async def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


class SimTemplate:
    """The simulated engines' tokenizer and chat template (the code their `/tokenize` runs)."""

    def __init__(self, vocab_size: int) -> None:
        self.tokenizer = SimTokenizer(vocab_size)

    async def render(self, messages: list[dict[str, Any]], tools: list[dict] | None,
                     generation_prompt: bool) -> list[int]:
        try:
            req = TokenizeChatRequest(messages=messages, tools=tools,
                                      add_generation_prompt=generation_prompt)
            return chat_prompt(req.messages, generation_prompt, False, self.tokenizer,
                               req.tools).token_ids
        except (ApiError, ValidationError) as exc:
            raise RenderError(str(exc)[:500]) from exc

    async def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)


@dataclass(frozen=True, slots=True)
class Frame:
    ids: list[int]  # the frame rendered without a generation prompt
    closing: list[int]  # the template's tokens after an assistant message's content


class ChatRenderer:
    """Renders episodes' messages with one template source; frames cached per tools."""

    def __init__(self, source: TemplateSource) -> None:
        self.source = source
        self._frames: dict[str, Frame] = {}

    async def first(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        """The first call's prompt: the whole conversation with the generation prompt."""
        return await self.source.render(messages, tools, True)

    async def next_input(self, last_token: int | None, messages: list[dict[str, Any]],
                         tools: list[dict] | None) -> list[int]:
        """The tokens a later call adds after the history, which ends with the model's output
        (`last_token`: its last id): the rest of the template's closing of that reply, then
        `messages` (the new ones) and the generation prompt."""
        frame = await self._frame(tools)
        full = await self.source.render(_FRAME + messages, tools, True)
        if full[:len(frame.ids)] != frame.ids:
            raise RenderError("the chat template renders a conversation differently when "
                              "messages follow it; the gateway cannot extend the episode's "
                              "tokens")
        closing = frame.closing
        if closing and last_token == closing[0]:
            closing = closing[1:]  # the model generated the end-of-turn token itself
        return closing + full[len(frame.ids):]

    async def _frame(self, tools: list[dict] | None) -> Frame:
        key = json.dumps(tools or [], sort_keys=True)
        frame = self._frames.get(key)
        if frame is None:
            asked, answered, content = await asyncio.gather(
                self.source.render(_FRAME[:1], tools, True),
                self.source.render(_FRAME, tools, False),
                self.source.encode(_FRAME[1]["content"]))
            at = len(asked) + len(content)
            if answered[:len(asked)] == asked and answered[len(asked):at] == content:
                closing = answered[at:]
            else:  # a template that rewrites the reply: close with nothing, add messages only
                closing = []
            frame = Frame(ids=answered, closing=closing)
            if len(self._frames) > 1024:
                self._frames.clear()
            self._frames[key] = frame
        return frame
