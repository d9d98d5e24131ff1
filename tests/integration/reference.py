"""Independent references: transformers' BertModel on the same checkpoint, and test inputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def reference_model(folder: Path):
    """transformers' own BertModel on the same checkpoint: the independent reference."""
    import torch
    from transformers import BertModel

    torch.set_num_threads(2)
    return BertModel.from_pretrained(str(folder), attn_implementation="eager").eval()


def padded_batch(rng: np.random.Generator, batch: int, seq: int, vocab: int):
    """Random tokens; row 0 is full length, the others are padded to ``seq`` with a real mask."""
    lengths = [seq] + [int(rng.integers(1, seq + 1)) for _ in range(batch - 1)]
    ids = np.zeros((batch, seq), dtype=np.int64)
    mask = np.zeros((batch, seq), dtype=np.int64)
    types = np.zeros((batch, seq), dtype=np.int64)
    for row, length in enumerate(lengths):
        ids[row, :length] = rng.integers(min(1000, vocab // 2), vocab, length)
        ids[row, 0] = 101  # [CLS]
        mask[row, :length] = 1
        types[row, length // 2 : length] = 1  # a second segment, as in sentence pairs
    return ids, mask, types


def reference_hidden(model, ids, mask, types) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            token_type_ids=torch.from_numpy(types),
        )
    return out.last_hidden_state.numpy()


def as_layout_answers(engine, hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """transformers' hidden states as ``engine``'s layout answers them: the packed layout (the
    CPU default) computes nothing at padding and answers zeros there; the padded one computes
    every position."""
    return hidden * mask[..., None] if engine.packed else hidden
