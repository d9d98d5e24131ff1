"""How close a model's output is to its reference, as the benchmarks' accuracy columns print it.
Numpy only: the GPU host imports it too (``bench_gpu.py``)."""

from __future__ import annotations

import numpy as np


def token_agreement(ours: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """(the worst token's cosine, the max abs error) of hidden states [..., hidden]."""
    a, b = ours.reshape(-1, ours.shape[-1]).astype(np.float64), reference.reshape(-1, ours.shape[-1])
    cosine = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(cosine.min()), float(np.abs(a - b).max())
