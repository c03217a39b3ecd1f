"""The simulated tokenizer: exact text round-trips, ChatML template, special tokens, id layout."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sim.server.tokenizer import FIRST_WORD_ID, ChatMessage, SimTokenizer

TOK = SimTokenizer(151_936)


@given(st.text())
def test_text_round_trips_exactly(text: str) -> None:
    ids = TOK.encode(text)
    assert all(0 <= i < TOK.vocab_size for i in ids)
    assert TOK.decode(ids) == text


def test_special_tokens_are_single_ids_and_words_compress() -> None:
    ids = TOK.encode("<|im_start|>user\nthe cat sat<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 == TOK.eos_token_id
    assert len(TOK.encode(" the cat sat on the mat")) == 6  # one id per short word


def test_generated_ids_decode_to_printable_pieces_that_re_encode() -> None:
    word_ids = [FIRST_WORD_ID + k for k in (0, 5, 700, 18_000)]  # space-prefixed pieces
    text = TOK.decode(word_ids)
    assert text.isprintable() and text.startswith(" ")
    assert TOK.encode(text) == word_ids
    high = TOK.vocab_size - 1  # past the word pieces: folds onto one
    assert TOK.piece(high).strip().isalpha()


def test_chat_template_is_chatml_and_prefix_stable() -> None:
    turn1 = [ChatMessage("system", "be brief"), ChatMessage("user", "hi")]
    text1 = TOK.apply_chat_template(turn1)
    assert text1 == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                     "<|im_start|>assistant\n")
    turn2 = [*turn1, ChatMessage("assistant", "hello"), ChatMessage("user", "more")]
    ids1, ids2 = TOK.encode(text1), TOK.encode(TOK.apply_chat_template(turn2))
    assert ids2[: len(ids1)] == ids1  # a follow-up turn extends the previous prompt's tokens
    assert TOK.apply_chat_template(turn1, add_generation_prompt=False).endswith("<|im_end|>\n")
    assert TOK.apply_chat_template(turn2, add_generation_prompt=False,
                                   continue_final_message=True).endswith("more")


SLOW = SimTokenizer(151_936)
SLOW._high_byte_ids = frozenset(range(151_936))  # every sequence takes the id-by-id path


@given(st.lists(st.one_of(st.integers(0, 300), st.integers(0, 151_935)), max_size=60),
       st.booleans())
def test_bulk_pieces_and_decode_agree_with_one_id_at_a_time(ids: list[int], skip: bool) -> None:
    """`pieces` and the joined fast path of `decode` (no byte that could start or continue a
    multi-byte character) give what the id-by-id path gives; ids below 300 are the special
    tokens, the bytes and the first word pieces."""
    assert TOK.pieces(ids, skip) == [TOK.piece(i, skip) for i in ids]
    assert TOK.decode(ids, skip) == SLOW.decode(ids, skip)


def test_an_id_outside_the_vocabulary_is_named() -> None:
    import pytest
    for ids in ([5, 151_936], [-1]):
        with pytest.raises(ValueError, match=f"token id {ids[-1]} is out of vocabulary"):
            TOK.pieces(ids)
        with pytest.raises(ValueError, match="out of vocabulary"):
            TOK.decode(ids)
