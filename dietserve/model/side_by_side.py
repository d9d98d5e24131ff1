"""One parameter of our layout from checkpoint tensors: each transposed where the model stores
the linear weight input-major, then side by side along the last axis (the fused query, key and
value layer). Numpy only, no TVM: the GPU host, which has only TVM's runtime, assembles the
artifact's weights from a checkpoint with it too (``tests/gpu/remote_check.py``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def side_by_side(tensors: Sequence[np.ndarray], transposed: bool) -> np.ndarray:
    """The float32 parameter made of ``tensors`` (each ``.T`` first if ``transposed``)."""
    parts = [np.asarray(t).astype(np.float32, copy=False) for t in tensors]
    parts = [part.T for part in parts] if transposed else parts
    if len({part.shape[:-1] for part in parts}) > 1:
        raise ValueError(f"tensors of shapes {[part.shape for part in parts]} do not stack side by side")
    return np.ascontiguousarray(parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1))
