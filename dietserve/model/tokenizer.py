"""Text -> token ids with the checkpoint's own ``tokenizer.json`` (no torch, no transformers)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer


class TokenizerError(ValueError):
    """The tokenizer files are missing or unusable."""


@dataclass(frozen=True)
class Encoded:
    input_ids: np.ndarray  # int64 [batch, seq]
    attention_mask: np.ndarray  # int64 [batch, seq]
    token_type_ids: np.ndarray  # int64 [batch, seq]


class TextTokenizer:
    """Pads a batch to its longest member and truncates to ``max_length`` tokens."""

    def __init__(self, tokenizer: Tokenizer, max_length: int):
        self.max_length = max_length
        self._tokenizer = tokenizer
        self._tokenizer.enable_truncation(max_length)
        pad_id = self._tokenizer.token_to_id("[PAD]")
        self._tokenizer.enable_padding(pad_id=0 if pad_id is None else pad_id)

    @classmethod
    def from_folder(cls, folder: Path, max_length: int) -> TextTokenizer:
        """``tokenizer.json`` when present; otherwise a WordPiece tokenizer from ``vocab.txt``
        (older BERT checkpoints), lower-casing as ``tokenizer_config.json`` says."""
        folder = Path(folder)
        if (folder / "tokenizer.json").is_file():
            return cls(Tokenizer.from_file(str(folder / "tokenizer.json")), max_length)
        if (folder / "vocab.txt").is_file():
            from tokenizers import BertWordPieceTokenizer

            settings_file = folder / "tokenizer_config.json"
            settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
            wordpiece = BertWordPieceTokenizer(
                str(folder / "vocab.txt"),
                lowercase=bool(settings.get("do_lower_case", True)),
                strip_accents=settings.get("strip_accents"),
                handle_chinese_chars=bool(settings.get("tokenize_chinese_chars", True)),
            )
            return cls(wordpiece._tokenizer, max_length)
        raise TokenizerError(f"{folder} has neither tokenizer.json nor vocab.txt")

    def encode(self, texts: list[str]) -> Encoded:
        if not texts:
            raise TokenizerError("no texts to encode")
        batch = self._tokenizer.encode_batch(list(texts))
        return Encoded(
            input_ids=np.array([e.ids for e in batch], dtype=np.int64),
            attention_mask=np.array([e.attention_mask for e in batch], dtype=np.int64),
            token_type_ids=np.array([e.type_ids for e in batch], dtype=np.int64),
        )
