"""Tokenization from the checkpoint folder, with tokenizer.json or only vocab.txt."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from dietserve.model.presets import default_model_folder
from dietserve.model.tokenizer import TEXT_BYTES_PER_TOKEN, TextTokenizer, TokenizerError
from dietserve.runtime.errors import InputTooLong

TEXTS = ["Hello, World!", "Dynamic shapes need shape-generic micro-kernels.", "naïve café"]


def test_vocab_txt_alone_tokenizes_like_tokenizer_json(tmp_path: Path) -> None:
    for name in ("vocab.txt", "tokenizer_config.json"):
        shutil.copy(default_model_folder() / name, tmp_path / name)
    full = TextTokenizer.from_folder(default_model_folder(), 512).encode(TEXTS)
    vocab_only = TextTokenizer.from_folder(tmp_path, 512).encode(TEXTS)
    np.testing.assert_array_equal(full.input_ids, vocab_only.input_ids)
    np.testing.assert_array_equal(full.attention_mask, vocab_only.attention_mask)


def test_batch_is_padded_and_truncated() -> None:
    encoded = TextTokenizer.from_folder(default_model_folder(), 8).encode(["short", "a b c d e f g h i j k"])
    assert encoded.input_ids.shape == (2, 8)
    assert encoded.attention_mask[0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert encoded.input_ids[1, -1] == 102  # [SEP] kept at the end after truncation


@pytest.mark.parametrize(("settings", "expected"), [
    ({"max_seq_length": 8}, 8), ({"max_seq_length": 1000}, 512), ({"do_lower_case": False}, 512), (None, 512),
    ({"max_seq_length": "8"}, "max_seq_length must be a positive integer, got '8'"),
    ({"max_seq_length": 0}, "max_seq_length must be a positive integer, got 0"), ([8], "is not a JSON object"),
])
def test_sentence_transformers_max_seq_length_bounds_the_text(tmp_path: Path, settings, expected) -> None:
    """sentence-transformers' ``max_seq_length`` cuts texts where it is shorter than the positions."""
    shutil.copy(default_model_folder() / "tokenizer.json", tmp_path / "tokenizer.json")
    if settings is not None:
        (tmp_path / "sentence_bert_config.json").write_text(json.dumps(settings))
    if isinstance(expected, str):
        with pytest.raises(TokenizerError, match=re.escape(expected)):
            TextTokenizer.from_folder(tmp_path, 512)
        return
    tokenizer = TextTokenizer.from_folder(tmp_path, 512)
    assert tokenizer.max_length == expected and tokenizer.byte_limit == TEXT_BYTES_PER_TOKEN * expected
    assert tokenizer.encode(["word " * 600]).input_ids.shape == (1, expected)


def test_folder_without_tokenizer_is_explained(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="neither tokenizer.json nor vocab.txt"):
        TextTokenizer.from_folder(tmp_path, 16)
    with pytest.raises(TokenizerError, match="no texts"):
        TextTokenizer.from_folder(default_model_folder(), 16).encode([])


def _reference(max_length: int):
    """The checkpoint's tokenizer as the tokenizers library pads and truncates it."""
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(default_model_folder() / "tokenizer.json"))
    reference.enable_truncation(max_length)
    reference.enable_padding(pad_id=reference.token_to_id("[PAD]"))
    return reference


def test_truncated_batch_equals_the_tokenizers_library() -> None:
    texts = TEXTS + ["one two three four five six seven eight nine ten eleven twelve"]
    encoded = TextTokenizer.from_folder(default_model_folder(), 8).encode(texts, truncate=True)
    expected = _reference(8).encode_batch(texts)
    np.testing.assert_array_equal(encoded.input_ids, [e.ids for e in expected])
    np.testing.assert_array_equal(encoded.attention_mask, [e.attention_mask for e in expected])
    np.testing.assert_array_equal(encoded.token_type_ids, [e.type_ids for e in expected])


def test_a_text_over_the_maximum_is_refused_naming_index_count_and_maximum() -> None:
    tokenizer = TextTokenizer.from_folder(default_model_folder(), 8)
    texts = ["short", "one two three four five six seven eight"]  # 8 words + [CLS] + [SEP]
    with pytest.raises(InputTooLong, match="text 1 has 10 tokens, over the model's maximum of 8"):
        tokenizer.encode(texts, truncate=False)
    assert tokenizer.encode(texts[:1], truncate=False).input_ids.shape == (1, 3)  # fits: no error


def test_a_text_cut_to_the_byte_limit_is_too_long_without_truncation() -> None:
    tokenizer = TextTokenizer.from_folder(default_model_folder(), 8)
    # What a server keeps of a text over byte_limit: the part read may hold few tokens (long
    # words become one [UNK]), yet the whole text was never counted.
    prefix = "x" * tokenizer.byte_limit
    with pytest.raises(InputTooLong, match=f"longer than the {tokenizer.byte_limit} bytes"):
        tokenizer.encode(["fine", prefix], truncate=False, clipped={1})
    english = ("word " * tokenizer.byte_limit)[: tokenizer.byte_limit]
    with pytest.raises(InputTooLong, match=r"hold \d+ tokens"):
        tokenizer.encode([english], truncate=False, clipped={0})
    assert tokenizer.encode([english], truncate=True, clipped={0}).input_ids.shape == (1, 8)


def test_truncation_keeping_the_last_tokens_equals_transformers_left_truncation() -> None:
    from transformers import AutoTokenizer

    texts = TEXTS + ["one two three four five six seven eight nine ten eleven twelve"]
    encoded = TextTokenizer.from_folder(default_model_folder(), 8).encode(texts, truncate=True, keep_last=True)
    reference = AutoTokenizer.from_pretrained(str(default_model_folder()), truncation_side="left")
    expected = reference(texts, truncation=True, max_length=8, padding=True)["input_ids"]
    np.testing.assert_array_equal(encoded.input_ids, expected)
    assert encoded.input_ids[-1, 1] == reference.convert_tokens_to_ids("seven")  # [CLS] seven ... twelve [SEP]


def test_a_text_over_the_byte_limit_keeps_its_first_or_last_bytes_whole_characters() -> None:
    from dietserve.server.codec import texts_of  # what a server reads of a text before tokenizing

    text = ("é" * 5 + "abc").encode()  # 13 bytes; 6 kept: whole characters only
    assert texts_of("BYTES", [text, b"ok"], 6) == (["ééé", "ok"], {0})
    assert texts_of("BYTES", [text, b"ok"], 6, keep_last=True) == (["éabc", "ok"], {0})
    assert texts_of("BYTES", [text], 13, keep_last=True) == ([text.decode()], set())


PAIRS = [("How many people live in Berlin?", "Berlin has a population of 3,520,031 registered inhabitants."),
         ("A man is eating food.", "A man is eating a piece of bread.")]


def _transformers_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_folder()))


def test_pairs_encode_as_the_checkpoints_tokenizer_with_two_segments() -> None:
    encoded = TextTokenizer.from_folder(default_model_folder(), 512).encode(PAIRS, truncate=False)
    expected = _transformers_tokenizer()([a for a, _ in PAIRS], [b for _, b in PAIRS], padding=True,
                                         return_tensors="np")
    for name in ("input_ids", "attention_mask", "token_type_ids"):
        np.testing.assert_array_equal(getattr(encoded, name), expected[name])
    assert set(np.unique(encoded.token_type_ids[encoded.attention_mask == 1])) == {0, 1}


def test_truncated_pairs_cut_the_longest_first_as_cross_encoder_does() -> None:
    """sentence-transformers' CrossEncoder tokenizes with truncation="longest_first"."""
    pairs = PAIRS + [("short query", "a long document " * 20), ("a long query " * 20, "short document")]
    encoded = TextTokenizer.from_folder(default_model_folder(), 16).encode(pairs, truncate=True)
    expected = _transformers_tokenizer()([a for a, _ in pairs], [b for _, b in pairs], padding=True,
                                         truncation="longest_first", max_length=16, return_tensors="np")
    for name in ("input_ids", "attention_mask", "token_type_ids"):
        np.testing.assert_array_equal(getattr(encoded, name), expected[name])


def test_a_pair_over_the_maximum_is_refused_naming_pair_count_and_maximum() -> None:
    tokenizer = TextTokenizer.from_folder(default_model_folder(), 16)
    fits = ("one two three four five six", "seven eight nine ten eleven twelve thirteen")  # 13 words + 3 specials
    assert tokenizer.encode([("short", "pair"), fits], truncate=False).input_ids.shape == (2, 16)
    over = (fits[0], fits[1] + " fourteen")
    with pytest.raises(InputTooLong, match="pair 4 has 17 tokens, over the model's maximum of 16"):
        tokenizer.encode([("short", "pair"), over], truncate=False, first=3)
    with pytest.raises(InputTooLong, match="pair 0 is longer than"):
        tokenizer.encode([over], truncate=False, clipped={0})
