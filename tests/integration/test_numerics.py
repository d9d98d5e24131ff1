"""One compiled artifact per model serves every batch size and sequence length, matching
transformers' BertModel to 1e-4 on last_hidden_state, padded batches included (where
transformers' own float32 run is off by more, its float64 run is the judge). The models are in
the CPU's default layout, packed (zeros at padding); MiniLM in the padded layout too, the graph
CUDA builds."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest

from .reference import as_layout_answers, padded_batch, reference_hidden

SEQ_LENS = [1, 2, 7, 31, 64, 127, 128, 300, 512]
BATCH_SIZES = [1, 3, 8]
TOLERANCE = 1e-4


@functools.lru_cache(maxsize=2)
def _in_float64(reference):
    """A float64 copy of a reference model, made once per model (a deep copy of bert-base takes
    seconds and 880 MB)."""
    return copy.deepcopy(reference).double()


def _check(engine, reference, batch: int, seq: int) -> None:
    rng = np.random.default_rng(batch * 1000 + seq)
    ids, mask, types = padded_batch(rng, batch, seq, engine.vocab_size)
    ours = engine.run(ids, mask, types).last_hidden_state
    expected = as_layout_answers(engine, reference_hidden(reference, ids, mask, types), mask)
    assert ours.shape == expected.shape
    error = float(np.abs(ours - expected).max())
    if error <= TOLERANCE:
        return
    # transformers in float32 is itself off the exact answer by more than 1e-4 at some padded
    # positions on some CPUs (1.3e-4 seen on AVX-512, where its reductions run in another
    # order). There the exact answer (transformers in float64) decides: ours must be no further
    # from it than transformers' float32 run, or within 1e-4 of it; real tokens stay within 1e-4.
    real = mask.astype(bool)
    real_error = float(np.abs(ours - expected)[real].max())
    assert real_error <= TOLERANCE, f"batch={batch} seq={seq}: max abs error {real_error:.2e} on real tokens"
    exact = as_layout_answers(engine, reference_hidden(_in_float64(reference), ids, mask, types), mask)
    ours_vs_exact = float(np.abs(ours - exact).max())
    reference_vs_exact = float(np.abs(expected - exact).max())
    assert ours_vs_exact <= max(TOLERANCE, reference_vs_exact), (
        f"batch={batch} seq={seq}: max abs error {error:.2e} against transformers (float32), "
        f"{ours_vs_exact:.2e} against float64, where transformers (float32) is off by {reference_vs_exact:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("batch", BATCH_SIZES)
@pytest.mark.parametrize("seq", SEQ_LENS)
def test_minilm_matches_transformers(minilm_engine, minilm_reference, batch: int, seq: int) -> None:
    _check(minilm_engine, minilm_reference, batch, seq)


@pytest.mark.slow
@pytest.mark.parametrize("batch", BATCH_SIZES)
@pytest.mark.parametrize("seq", [1, 7, 128, 512])
def test_minilm_in_the_padded_layout_matches_transformers(minilm_padded_engine, minilm_reference, batch: int,
                                                          seq: int) -> None:
    assert not minilm_padded_engine.packed
    _check(minilm_padded_engine, minilm_reference, batch, seq)


@pytest.mark.slow
@pytest.mark.parametrize("batch", BATCH_SIZES)
@pytest.mark.parametrize("seq", SEQ_LENS)
def test_bert_base_matches_transformers(bert_base_engine, bert_base_reference, batch: int, seq: int) -> None:
    _check(bert_base_engine, bert_base_reference, batch, seq)


def test_padding_does_not_change_a_sentence(minilm_engine) -> None:
    """A padded row's valid positions equal the same sentence run alone (the mask is real)."""
    rng = np.random.default_rng(7)
    ids, mask, types = padded_batch(rng, 3, 40, minilm_engine.vocab_size)
    batched = minilm_engine.run(ids, mask, types).last_hidden_state
    length = int(mask[1].sum())
    alone = minilm_engine.run(ids[1:2, :length], mask[1:2, :length], types[1:2, :length]).last_hidden_state
    assert np.abs(batched[1, :length] - alone[0]).max() <= TOLERANCE
