"""Tokenization from the checkpoint folder, with tokenizer.json or only vocab.txt."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from dietserve.model.presets import default_model_folder
from dietserve.model.tokenizer import TextTokenizer, TokenizerError

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


def test_folder_without_tokenizer_is_explained(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="neither tokenizer.json nor vocab.txt"):
        TextTokenizer.from_folder(tmp_path, 16)
    with pytest.raises(TokenizerError, match="no texts"):
        TextTokenizer.from_folder(default_model_folder(), 16).encode([])
