"""Seeded random checkpoint tensors for a parameter layout, drawn as Hugging Face's
BertPreTrainedModel initialises them (normal(0, std); LayerNorm weights about 1). Numpy only: the
GPU host, which has no TVM compiler, regenerates bert-base's weights with it from the carried
layout (``presets.random_weight_layout``) rather than carrying 440 MB (``tests/benchmarks/bench_gpu.py``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


def seeded_tensors(layout: Iterable[tuple[Sequence[int], Sequence[str], bool]], seed: int,
                   std: float = 0.02) -> dict[str, np.ndarray]:
    """Checkpoint tensors by name. ``layout``: for each parameter of our layout, in the compiled
    function's order, its shape, the checkpoint tensors side by side along its last axis and
    whether they are stored transposed (``[out, in]``). Biases and LayerNorm parameters get small
    noise too, so a test against a reference exercises every tensor rather than zeros and ones."""
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for shape, parts, transposed in layout:
        part_shape = (*shape[:-1], shape[-1] // len(parts))
        for part in parts:
            if part.endswith("LayerNorm.weight"):
                tensor = 1.0 + 0.02 * rng.standard_normal(part_shape)
            else:
                tensor = std * rng.standard_normal(part_shape)
            tensors[part] = np.ascontiguousarray(tensor.T if transposed else tensor, dtype=np.float32)
    return tensors
