"""Bad inputs get an error naming what is wrong, and the engine keeps working afterwards."""

from __future__ import annotations

import numpy as np
import pytest

from dietserve.runtime.engine import InputError

GOOD = np.array([[101, 7592, 2088, 102]], dtype=np.int64)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"input_ids": GOOD.astype(np.float32)}, "must hold integers"),
        ({"input_ids": GOOD[0]}, "must be 2-D"),
        ({"input_ids": np.zeros((1, 0), np.int64)}, "is empty"),
        ({"input_ids": np.zeros((0, 4), np.int64)}, "is empty"),
        ({"input_ids": np.full((1, 513), 101)}, "exceeds the model's maximum of 512"),
        ({"input_ids": np.full((9, 4), 101)}, "exceeds the artifact's maximum of 8"),
        ({"input_ids": GOOD + 40000}, "outside the vocabulary"),
        ({"input_ids": -GOOD}, "outside the vocabulary"),
        ({"input_ids": GOOD, "attention_mask": np.ones((1, 3), np.int64)}, "attention_mask has shape [1, 3]"),
        ({"input_ids": GOOD, "attention_mask": np.full((1, 4), 2)}, "only 0 and 1"),
        ({"input_ids": GOOD, "token_type_ids": np.full((1, 4), 2)}, "token_type_ids must lie in"),
    ],
)
def test_bad_input_is_rejected_with_a_clear_message(minilm_engine, kwargs, message) -> None:
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        minilm_engine.run(**kwargs)
    after = minilm_engine.run(GOOD)
    assert after.last_hidden_state.shape == (1, 4, 384)
    assert np.isfinite(after.last_hidden_state).all()


def test_defaults_equal_explicit_mask_and_segments(minilm_engine) -> None:
    implicit = minilm_engine.run(GOOD)
    explicit = minilm_engine.run(GOOD, np.ones_like(GOOD), np.zeros_like(GOOD))
    np.testing.assert_array_equal(implicit.sentence_embedding, explicit.sentence_embedding)


def test_engine_uses_every_allowed_cpu_without_pinning_the_caller(minilm_engine) -> None:
    import os

    before = os.sched_getaffinity(0)
    assert minilm_engine.threads == len(before)
    minilm_engine.run(GOOD)
    assert os.sched_getaffinity(0) == before


def test_kernel_clamps_ids_that_bypass_validation(minilm_engine) -> None:
    """Defense in depth: the compiled lookup never reads outside the embedding table."""
    import tvm

    from dietserve.runtime.engine import packed_inputs

    ids = np.array([[101, 10**6, -5, 102]], dtype=np.int64)
    arrays = (ids, np.ones_like(ids), np.zeros_like(ids), np.arange(4))
    if minilm_engine.packed:
        arrays = packed_inputs(*arrays)
    inputs = [tvm.runtime.tensor(a) for a in arrays]
    hidden, _ = minilm_engine.artifact.vm["forward"](*inputs, *minilm_engine.artifact.params)
    clamped = np.clip(ids, 0, minilm_engine.vocab_size - 1)
    expected = minilm_engine.run(clamped).last_hidden_state
    np.testing.assert_allclose(hidden.numpy(), expected, atol=1e-6)


def test_inputs_reach_the_model_from_any_numpy_layout(minilm_engine) -> None:
    """The engine hands its inputs to TVM through 64-byte-aligned copies (``_host_tensor``):
    views at odd offsets, strided and non-native arrays give the answer a plain array gives,
    and the outputs are the engine's own copies, not views of the VM's pooled buffers."""
    expected = minilm_engine.run(GOOD)
    backing = np.zeros(GOOD.size + 1, np.int64)
    backing[1:] = GOOD[0]
    offset = backing[1:].reshape(1, -1)  # 8 bytes past an allocation's start: never 64-byte aligned
    strided = np.repeat(GOOD, 2, axis=1)[:, ::2]
    for ids in (offset, strided, GOOD.astype(np.int32), GOOD.astype(">i8")):
        got = minilm_engine.run(ids)
        np.testing.assert_array_equal(got.last_hidden_state, expected.last_hidden_state)
    kept = minilm_engine.run(GOOD).last_hidden_state.copy()
    first = minilm_engine.run(GOOD).last_hidden_state
    minilm_engine.run(np.full((1, 4), 2000, np.int64))  # the VM reuses its buffers for this run
    np.testing.assert_array_equal(first, kept)
