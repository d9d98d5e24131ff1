"""Text -> token ids with the checkpoint's own ``tokenizer.json`` (no torch, no transformers)."""

from __future__ import annotations

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

    def __init__(self, tokenizer_file: Path, max_length: int):
        if not Path(tokenizer_file).is_file():
            raise TokenizerError(f"no tokenizer at {tokenizer_file}")
        self.max_length = max_length
        self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self._tokenizer.enable_truncation(max_length)
        pad_id = self._tokenizer.token_to_id("[PAD]")
        self._tokenizer.enable_padding(pad_id=0 if pad_id is None else pad_id)

    @classmethod
    def from_folder(cls, folder: Path, max_length: int) -> TextTokenizer:
        return cls(Path(folder) / "tokenizer.json", max_length)

    def encode(self, texts: list[str]) -> Encoded:
        if not texts:
            raise TokenizerError("no texts to encode")
        batch = self._tokenizer.encode_batch(list(texts))
        return Encoded(
            input_ids=np.array([e.ids for e in batch], dtype=np.int64),
            attention_mask=np.array([e.attention_mask for e in batch], dtype=np.int64),
            token_type_ids=np.array([e.type_ids for e in batch], dtype=np.int64),
        )
