"""Tokenizers: counts, ids, and incremental decoding that never splits a character."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from gateway.text.tokenizer import REPLACEMENT, ByteTokenizer, make_tokenizer

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
    with pytest.raises(ValueError, match=r"tokenizer: expected 'bytes' or a tokenizer.json"):
        make_tokenizer("/nowhere/tokenizer.json")


MULTI_BYTE = [
    "naïve café — 東京 🚀👩‍👩‍👧 ünïcödé ✓",
    "<|im_start|>assistant\n😀😀 e=mc² ∑<|im_end|>",
    "  two  spaces\n\n",
]


def pushes(detokenizer_push, ids: list[int], sizes: list[int]) -> list[str]:
    """The text each push of ``sizes`` ids releases ('' where nothing is released yet)."""
    released, start = [], 0
    for size in sizes:
        released.append(detokenizer_push(ids[start : start + size]) or "")
        start += size
    return released


@pytest.mark.parametrize("seed", range(3))
def test_each_push_releases_what_tokenizers_decode_stream_releases_on_smollm2(smollm2, seed):
    """``tokenizers.decoders.DecodeStream`` as the oracle of every push, one id or several at a
    time, through multi-byte characters cut anywhere. It is not the detokenizer itself because
    it has no end of stream: what it still holds when a stream ends (a character cut by
    ``max_tokens``, and the text pushed with it) is lost, where ``flush`` shows it."""
    tokenizer = make_tokenizer(smollm2)
    vocabulary = Tokenizer.from_file(f"{smollm2}/tokenizer.json")
    rng = random.Random(seed)
    for text in MULTI_BYTE:
        ids = tokenizer.encode(text)
        for cut in range(1, len(ids) + 1):
            sizes = [1] * cut if seed == 0 else _sizes(rng, cut)
            ours, stream = tokenizer.detokenizer(), decoders.DecodeStream(skip_special_tokens=False)
            expected = pushes(lambda chunk, stream=stream: stream.step(vocabulary, chunk), ids, sizes)
            assert pushes(ours.push, ids, sizes) == expected
            assert "".join(expected) + ours.flush() == tokenizer.decode(ids[:cut])


def _sizes(rng: random.Random, total: int) -> list[int]:
    sizes = []
    while total:
        sizes.append(min(total, rng.randint(1, 4)))
        total -= sizes[-1]
    return sizes


def test_a_stream_cut_inside_a_character_ends_with_a_replacement_mark_not_silence(smollm2):
    tokenizer = make_tokenizer(smollm2)
    ids = tokenizer.encode("Paris 🚀")
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith(REPLACEMENT))
    detokenizer = tokenizer.detokenizer()
    assert detokenizer.push(ids[:cut]) == ""  # held whole: it ends in half a character
    assert detokenizer.flush() == tokenizer.decode(ids[:cut]) == "Paris " + REPLACEMENT
