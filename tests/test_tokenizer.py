"""Tokenizers: counts, ids, and incremental decoding that never splits a character."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from gateway.tokenizer import REPLACEMENT, ByteTokenizer, make_tokenizer

TEXT = "héllo wörld, 世界 says 🙂 to the café"


@pytest.fixture(scope="module")
def vocabulary(tmp_path_factory) -> str:
    """A real byte-level BPE tokenizer.json, trained here in milliseconds on a few lines."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([TEXT, "hello world", "the cat sat on the mat"] * 5, trainer)
    path = tmp_path_factory.mktemp("vocab") / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


def decoded_one_id_at_a_time(tokenizer, ids: list[int]) -> list[str]:
    detokenizer = tokenizer.detokenizer()
    return [detokenizer.push([token]) for token in ids] + [detokenizer.flush()]


def test_bytes_encode_decode_and_count_agree():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(TEXT)
    assert list(ids) == list(TEXT.encode()) and tokenizer.count(TEXT) == len(ids)
    assert tokenizer.decode(list(ids)) == TEXT


def test_a_byte_stream_holds_a_split_character_until_its_last_byte():
    detokenizer = ByteTokenizer().detokenizer()
    first, second = "é".encode()
    assert detokenizer.push([ord("h"), first]) == "h"
    assert detokenizer.push([second]) == "é"
    assert detokenizer.push([0xE4]) == "" and detokenizer.flush() == REPLACEMENT  # cut short at the end


def test_a_subword_vocabulary_loads_from_its_file_or_directory(vocabulary):
    tokenizer = make_tokenizer(vocabulary)
    ids = tokenizer.encode(TEXT)
    assert tokenizer.decode(ids) == TEXT and tokenizer.count(TEXT) == len(ids) < len(TEXT.encode())
    assert make_tokenizer(vocabulary.rsplit("/", 1)[0]).encode(TEXT) == ids
    assert tokenizer.truncate(TEXT, len(ids)) == TEXT and tokenizer.count(tokenizer.truncate(TEXT, 3)) <= 3


def test_subword_ids_decode_one_at_a_time_into_whole_characters(vocabulary):
    tokenizer = make_tokenizer(vocabulary)
    pieces = decoded_one_id_at_a_time(tokenizer, tokenizer.encode(TEXT))
    assert "".join(pieces) == TEXT
    assert not any(REPLACEMENT in piece for piece in pieces)
    assert "" in pieces  # some ids end mid-character (the emoji's bytes): held, not shown as U+FFFD


@given(text=st.text(st.sampled_from("ab é世🙂\n"), max_size=40))
def test_any_text_streams_back_exactly(vocabulary, text):
    for tokenizer in (ByteTokenizer(), make_tokenizer(vocabulary)):
        pieces = decoded_one_id_at_a_time(tokenizer, list(tokenizer.encode(text)))
        assert "".join(pieces) == text and not any(REPLACEMENT in piece for piece in pieces)


def test_an_unknown_tokenizer_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="tokenizer: expected 'bytes' or a tokenizer.json"):
        make_tokenizer("/nowhere/tokenizer.json")
