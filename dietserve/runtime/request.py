"""The transport-free request: validated token tensors, what to return, and until when."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

OUTPUTS = ("last_hidden_state", "sentence_embedding")  # an embedding model's; a classifier's end in logits


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

    def reply_bytes(self, output_shapes: Mapping[str, tuple[int, ...]]) -> int:
        """Bytes of float32 output the answer carries. ``output_shapes``: the engine's (name ->
        shape, -1 for the batch and the sequence length), so every output counts at its own
        width (concatenated pooling modes, Dense layers, a classifier's labels)."""
        def floats(shape: tuple[int, ...]) -> int:
            return math.prod(self.rows if axis == 0 else self.seq_len if dim < 0 else dim
                             for axis, dim in enumerate(shape))

        return 4 * sum(floats(output_shapes[name]) for name in self.outputs)
