"""The BERT options real checkpoints use (activation variants, eps, type vocabulary, sizes)
compile and match transformers, on small seeded random checkpoints written as HF folders."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dietserve.compile.artifact import CompileRequest, compile_artifact
from dietserve.model.config import BertConfig
from dietserve.model.presets import materialize_random_bert
from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.engine import Engine

from .reference import as_layout_answers, padded_batch, reference_hidden, reference_model

ACTIVATIONS = ["gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu", "silu"]


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_variant_matches_transformers(activation: str, tmp_path: Path, cache_dir: Path) -> None:
    config = BertConfig(vocab_size=500, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=80, hidden_act=activation, max_position_embeddings=64,
                        type_vocab_size=3, layer_norm_eps=1e-5)
    # Large weights put pre-activations at O(1), where the GELU variants differ by ~1e-3,
    # so a wrong variant fails this test (at BERT's 0.02 init they agree to ~1e-6).
    folder = materialize_random_bert(config, tmp_path / f"tiny-{activation}", seed=11, std=0.3)
    engine = Engine(load_artifact(compile_artifact(CompileRequest(model=str(folder), max_batch=4), cache_dir)))
    ids, mask, types = padded_batch(np.random.default_rng(3), 3, 37, config.vocab_size)
    types[:, 30:] = 2  # a third segment: type_vocab_size is honoured
    ours = engine.run(ids, mask, types).last_hidden_state
    expected = as_layout_answers(engine, reference_hidden(reference_model(folder), ids, mask, types), mask)
    assert np.abs(ours - expected).max() <= 1e-4


def test_a_capped_sequence_length_truncates_as_sentence_transformers_does(cache_dir: Path) -> None:
    """``--max-seq-len 32``: the model's tables end there and a longer text is cut to it, as
    sentence-transformers cuts it at the same ``max_seq_length``."""
    from sentence_transformers import SentenceTransformer

    from dietserve.model.presets import default_model_folder
    from dietserve.runtime.embedder import Embedder

    artifact = compile_artifact(CompileRequest(model="default", max_batch=4, max_seq_len=32), cache_dir)
    embedder = Embedder(Engine(load_artifact(artifact)))
    assert embedder.engine.max_seq_len == 32
    texts = ["A man is eating food.", "The quick brown fox jumps over the lazy dog. " * 20]
    reference = SentenceTransformer(str(default_model_folder()), device="cpu", local_files_only=True)
    reference.max_seq_length = 32
    np.testing.assert_allclose(embedder.embed(texts), reference.encode(texts), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="positions end at 512 tokens"):
        compile_artifact(CompileRequest(model="default", max_batch=4, max_seq_len=513), cache_dir)


def test_the_padded_layout_bounds_a_long_models_default_length(tmp_path: Path, cache_dir: Path) -> None:
    """The padded layout plans a batch's attention scores for its largest batch at its longest
    sequence: a model of 8,192 positions at the default 64 rows would plan 64 GiB of them (here
    4 heads), and its first call would fail to allocate them. Where --max-seq-len does not say,
    the length is the longest within ``PADDED_SCORES_BYTES``, and said; a length given past it
    is warned of."""
    from dietserve.compile.request import PADDED_SCORES_BYTES, open_checkpoint

    config = BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=80, max_position_embeddings=8192)
    folder = materialize_random_bert(config, tmp_path / "long", seed=13, std=0.3)
    said: list[str] = []
    request = CompileRequest(model=str(folder), layout="padded", analytic=True)
    engine = Engine(load_artifact(compile_artifact(request, cache_dir, progress=said.append)))
    longest = int((PADDED_SCORES_BYTES // (64 * 4 * 4)) ** 0.5)
    assert engine.max_seq_len == longest < 8192
    assert any(f"up to {longest} of the model's 8192 positions" in line and "attention scores" in line
               for line in said)
    ids, mask, types = padded_batch(np.random.default_rng(5), 2, 37, config.vocab_size)
    expected = as_layout_answers(engine, reference_hidden(reference_model(folder), ids, mask, types), mask)
    assert np.abs(engine.run(ids, mask, types).last_hidden_state - expected).max() <= 1e-4
    said.clear()  # the checkpoint a compile opens (without the build the first call showed)
    given = open_checkpoint(CompileRequest(model=str(folder), layout="padded", analytic=True, max_seq_len=4096),
                            cache_dir, progress=said.append)
    assert given.config.max_length == 4096
    assert any("plans 16.0 GiB for a batch's attention scores at --max-batch 64 and --max-seq-len 4096" in line
               for line in said)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_a_width_of_one_weight_panel_builds_from_the_hardware_model(layout: str, tmp_path: Path,
                                                                     cache_dir: Path) -> None:
    """A hidden width of 48 is one panel of the hardware model's widest register tile (3 vectors
    of 16): packed in one panel, its index the constant 0, the schedules could not match it and
    the cold start's build failed. Its plans now pack in two panels or more."""
    config = BertConfig(vocab_size=500, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=80, max_position_embeddings=64)
    folder = materialize_random_bert(config, tmp_path / "narrow", seed=17, std=0.3)
    request = CompileRequest(model=str(folder), max_batch=4, layout=layout, analytic=True)
    engine = Engine(load_artifact(compile_artifact(request, cache_dir)))
    ids, mask, types = padded_batch(np.random.default_rng(7), 3, 37, config.vocab_size)
    expected = as_layout_answers(engine, reference_hidden(reference_model(folder), ids, mask, types), mask)
    assert np.abs(engine.run(ids, mask, types).last_hidden_state - expected).max() <= 1e-4
