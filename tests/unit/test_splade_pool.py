"""The packed sparse encoder's pooling kernel (``kernels/cpu_varlen/splade_pool.py``) against
numpy: every strategy and activation, sequences of 1 to 512 tokens and one of none, and
vocabularies of whole column blocks, of part of one, and of a remainder after whole vectors."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from dietserve.kernels.cpu_varlen.splade_pool import SPLADE_ACTIVATIONS, SPLADE_STRATEGIES, splade_pool
from dietserve.kernels.tir.build import build

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})
LENGTHS = [1, 0, 7, 512, 33, 2]


def reference(logits: np.ndarray, starts: np.ndarray, strategy: str, activation: str) -> np.ndarray:
    """sentence-transformers' SpladePooling on each sequence's rows (a sequence of none: zeros)."""
    rows = []
    for begin, end in zip(starts[:-1], starts[1:], strict=True):
        values = np.log1p(np.maximum(logits[begin:end].astype(np.float64), 0.0))
        if activation == "log1p_relu":
            values = np.log1p(values)
        if end == begin:
            rows.append(np.zeros(logits.shape[1]))
        else:
            rows.append(values.max(axis=0) if strategy == "max" else values.sum(axis=0))
    return np.array(rows)


@pytest.mark.parametrize(("vocab", "columns"), [(1024, 1024), (250, 256), (3001, 3072)])
@pytest.mark.parametrize("strategy", SPLADE_STRATEGIES)
@pytest.mark.parametrize("activation", SPLADE_ACTIVATIONS)
def test_pooling_matches_numpy(vocab: int, columns: int, strategy: str, activation: str) -> None:
    """(The logits' padding columns, past the vocabulary, are left out.)"""
    func = splade_pool(vocab, strategy, activation, columns).with_attr("global_symbol", "main")
    kernel = build(tvm.IRModule({"main": func}), TARGET)["main"]
    rng = np.random.default_rng(vocab)
    starts = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int64)
    logits = (rng.standard_normal((starts[-1], columns)) - 1.0).astype(np.float32)
    out = tvm.runtime.tensor(np.full((len(LENGTHS), vocab), np.nan, np.float32))
    kernel(tvm.runtime.tensor(logits), tvm.runtime.tensor(starts), out)
    expected = reference(logits[:, :vocab], starts, strategy, activation)
    assert 0 < (expected > 0).mean() < 1  # some weights zero, some not
    np.testing.assert_allclose(out.numpy(), expected, rtol=2e-6, atol=2e-6 if strategy == "max" else 1e-4)


def test_an_unknown_strategy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="SPLADE pooling 'mean' of 'relu'"):
        splade_pool(100, "mean")
