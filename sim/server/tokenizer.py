"""A deterministic, download-free tokenizer with a ChatML chat template.

Id layout (all below the profile's `vocab_size`):
  0 .. 15                 special tokens (`SPECIAL_TOKENS`, the rest reserved);
  16 .. 271               one token per byte, so any text encodes and decodes exactly;
  272 .. 272+W-1          word pieces: " abc" (space + 1-3 lowercase letters) or "abc" (no space),
                          so ordinary English text takes ~3 chars per token rather than 1;
  above                   ids the engine may generate past the word pieces fold onto them
                          (id → word piece (id − 272) mod W), so every id decodes to printable text.

Encoding is greedy and unique: special tokens first (as HF tokenizers parse them in text), then
runs of `[ ]?[a-z]{1,3}` as word pieces, anything else byte by byte. decode(encode(s)) == s for
every string; encode(decode(ids)) == ids for sequences of space-prefixed word pieces.

The chat template is Qwen's ChatML with hermes tool calling (Qwen2.5/Qwen3): with `tools`, a
first system block lists them between `<tools>` tags and says how to call them (a first system
message given by the client opens that block; without one there is no default system prompt, as
in Qwen3's template and as the sim renders chats without tools); an assistant's calls follow its
content as `render_tool_call` writes them; consecutive `tool` messages share one user block of
`<tool_response>`s. Without tools or tool messages it is plain ChatML.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from itertools import product
from string import ascii_lowercase
from typing import Any

from broker.tool_calls import render_tool_call

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
NUM_SPECIAL_IDS = 16
BYTE_OFFSET = NUM_SPECIAL_IDS
FIRST_WORD_ID = BYTE_OFFSET + 256

_SPECIAL_RE = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")
_PIECE_RE = re.compile(r" ?[a-z]{1,3}|.", re.DOTALL)


def _word_pieces() -> list[str]:
    words = ["".join(p) for n in (1, 2, 3) for p in product(ascii_lowercase, repeat=n)]
    return [" " + w for w in words] + words


# The system block Qwen's template writes when a request has tools, around one JSON per tool.
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
# A tools block as rendered: the "<tools></tools>" mentioned in the preamble is no block.
_TOOLS_BLOCK_RE = re.compile(r"<tools>\n(.*?)\n</tools>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class MessageToolCall:
    """A call an assistant message made, with its arguments decoded from JSON."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[MessageToolCall, ...] = ()  # an assistant's calls, after its content


class SimTokenizer:
    """Text ↔ token ids for a vocabulary of `vocab_size` ids (word pieces cut to fit)."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size <= FIRST_WORD_ID:
            raise ValueError(f"vocab_size: must exceed {FIRST_WORD_ID}, got {vocab_size}")
        self.vocab_size = vocab_size
        self._pieces = _word_pieces()[: vocab_size - FIRST_WORD_ID]
        self._piece_ids = {p: FIRST_WORD_ID + i for i, p in enumerate(self._pieces)}
        self._special_ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
        self.eos_token_id = self._special_ids["<|im_end|>"]
        # Every id's piece, for bulk lookups (a reply with logprobs names each output token),
        # with special tokens and with them skipped; ids past the word pieces fold onto them.
        words = len(self._pieces)
        folded = self._pieces * (-(-(vocab_size - FIRST_WORD_ID) // words))
        table = [self.piece(i) for i in range(FIRST_WORD_ID)] + folded[:vocab_size - FIRST_WORD_ID]
        skipped = list(table)
        skipped[:NUM_SPECIAL_IDS] = [self.piece(i, True) for i in range(NUM_SPECIAL_IDS)]
        self._tables = {False: table, True: skipped}
        # Bytes that decode differently alone (U+FFFD) than in a multi-byte character.
        self._high_byte_ids = frozenset(range(BYTE_OFFSET + 0x80, FIRST_WORD_ID))

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in _SPECIAL_RE.split(text):
            if part in self._special_ids:
                ids.append(self._special_ids[part])
                continue
            for match in _PIECE_RE.finditer(part):
                piece = match.group()
                piece_id = self._piece_ids.get(piece)
                if piece_id is not None:
                    ids.append(piece_id)
                else:
                    ids.extend(BYTE_OFFSET + b for b in piece.encode("utf-8"))
        return ids

    def pieces(self, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
        """`piece` of every id in `ids`."""
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(f"tokens: token id {bad} is out of vocabulary")
        return list(map(self._tables[bool(skip_special_tokens)].__getitem__, ids))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Bytes are gathered and decoded together, so multi-byte characters survive."""
        pieces = self.pieces(ids, skip_special_tokens)
        if self._high_byte_ids.isdisjoint(ids):  # no byte that could join others
            return "".join(pieces)
        out: list[str] = []
        pending = bytearray()
        for token_id, piece in zip(ids, pieces):
            if BYTE_OFFSET <= token_id < FIRST_WORD_ID:
                pending.append(token_id - BYTE_OFFSET)
                continue
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            out.append(piece)
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def piece(self, token_id: int, skip_special_tokens: bool = False) -> str:
        """The text of one token; a lone byte that is not valid UTF-8 shows as U+FFFD."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"tokens: token id {token_id} is out of vocabulary")
        if token_id < NUM_SPECIAL_IDS:
            if skip_special_tokens or token_id >= len(SPECIAL_TOKENS):
                return ""
            return SPECIAL_TOKENS[token_id]
        if token_id < FIRST_WORD_ID:
            return bytes([token_id - BYTE_OFFSET]).decode("utf-8", errors="replace")
        return self._pieces[(token_id - FIRST_WORD_ID) % len(self._pieces)]

    def apply_chat_template(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """ChatML as Qwen's template renders it (see the module docstring):
        `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, and with `tools` (OpenAI
        function tools, as JSON objects) the hermes tool blocks. Rendering messages[:k] is a
        prefix of rendering messages wherever k does not split a run of tool messages."""
        parts = []
        rest = messages
        if tools:
            opening = ""
            if messages and messages[0].role == "system":
                opening, rest = messages[0].content + "\n\n", messages[1:]
            listed = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
            parts.append(f"<|im_start|>system\n{opening}{TOOLS_PREAMBLE}{listed}"
                         f"{TOOLS_POSTAMBLE}<|im_end|>\n")
        for i, m in enumerate(rest):
            if m.role == "tool":
                opens = i == 0 or rest[i - 1].role != "tool"
                closes = i == len(rest) - 1 or rest[i + 1].role != "tool"
                parts.append(("<|im_start|>user" if opens else "")
                             + f"\n<tool_response>\n{m.content}\n</tool_response>"
                             + ("<|im_end|>\n" if closes else ""))
            else:
                parts.append(f"<|im_start|>{m.role}\n{_with_calls(m)}<|im_end|>\n")
        if continue_final_message and messages:
            parts[-1] = parts[-1].removesuffix("<|im_end|>\n")
        elif add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)


def _with_calls(m: ChatMessage) -> str:
    """A message's content, then its calls, each on a line of its own after any text."""
    text = m.content
    for call in m.tool_calls:
        text += ("\n" if text else "") + render_tool_call(call.name, call.arguments)
    return text


def tools_in_prompt(text: str) -> list[dict[str, Any]]:
    """The tools listed in the last tools block of a rendered prompt (one JSON object a line, as
    `apply_chat_template` writes them; a line that is not one is skipped), [] without a block."""
    blocks = _TOOLS_BLOCK_RE.findall(text)
    if not blocks:
        return []
    tools = []
    for line in blocks[-1].split("\n"):
        try:
            tool = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(tool, dict):
            tools.append(tool)
    return tools
