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
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import product
from string import ascii_lowercase

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
NUM_SPECIAL_IDS = 16
BYTE_OFFSET = NUM_SPECIAL_IDS
FIRST_WORD_ID = BYTE_OFFSET + 256

_SPECIAL_RE = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")
_PIECE_RE = re.compile(r" ?[a-z]{1,3}|.", re.DOTALL)


def _word_pieces() -> list[str]:
    words = ["".join(p) for n in (1, 2, 3) for p in product(ascii_lowercase, repeat=n)]
    return [" " + w for w in words] + words


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


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
    ) -> str:
        """ChatML, as Qwen's template renders it: `<|im_start|>{role}\\n{content}<|im_end|>\\n`."""
        parts = [f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in messages]
        if continue_final_message and messages:
            parts[-1] = parts[-1].removesuffix("<|im_end|>\n")
        elif add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)
