"""The transport-free request: validated token tensors, what to return, and until when."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

OUTPUTS = ("last_hidden_state", "sentence_embedding")


@dataclass(frozen=True)
class EncoderRequest:
    input_ids: np.ndarray  # int64 [batch, seq], validated by Engine.validate
    attention_mask: np.ndarray
    token_type_ids: np.ndarray
    outputs: tuple[str, ...] = OUTPUTS  # in the order the client asked for them
    deadline: float | None = None  # time.monotonic() after which the answer is no longer wanted
    id: str = ""  # the client's request id, echoed in the answer

    @property
    def tokens(self) -> int:
        """Tokens the model reads, special tokens included, padding excluded."""
        return int(self.attention_mask.sum())

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def reply_bytes(self, hidden_size: int, embedding_size: int | None = None) -> int:
        """Bytes of float32 output the answer carries; ``embedding_size``: the sentence
        embedding's width where it is not ``hidden_size`` (pooling modes concatenated, Dense)."""
        per_row = {"last_hidden_state": self.seq_len * hidden_size, "sentence_embedding": embedding_size or hidden_size}
        return 4 * self.rows * sum(per_row[name] for name in self.outputs)
