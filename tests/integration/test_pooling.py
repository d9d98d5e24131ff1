"""Every sentence-transformers pooling mode, their concatenation, Dense modules and Normalize,
compiled into the artifact's sentence_embedding, against ``SentenceTransformer.encode`` on
sentence-transformers folders built around the default checkpoint's encoder.

Two compiles: the six modes concatenated (chosen with --pooling over a mean-pooled folder),
and mean pooling followed by two Dense modules and Normalize."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from dietserve.compile.artifact import CompileRequest, compile_artifact
from dietserve.model.heads import POOLING_MODES
from dietserve.model.presets import default_model_folder
from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.embedder import Embedder
from dietserve.runtime.engine import Engine

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "Two men pushed carts through the woods.",
    "Compilers for dynamic shapes tune micro-kernels once and dispatch each sequence length.",
    "Short.",
]
# Every mode's legacy flag, in sentence-transformers' concatenation order (that of POOLING_MODES).
FLAGS = {"cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens", "mean": "pooling_mode_mean_tokens",
         "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
         "weightedmean": "pooling_mode_weightedmean_tokens", "lasttoken": "pooling_mode_lasttoken"}
ENCODER_FILES = ("config.json", "model.safetensors", "tokenizer.json", "vocab.txt", "tokenizer_config.json",
                 "special_tokens_map.json", "sentence_bert_config.json", "config_sentence_transformers.json")
MAX_BATCH = 8


def _module(index: int, kind: str, path: str) -> dict:
    return {"idx": index, "name": str(index), "path": path, "type": f"sentence_transformers.models.{kind}"}


def sentence_transformers_folder(folder: Path, modes: tuple[str, ...], dense: tuple = (),
                                 normalize: bool = False) -> Path:
    """The default checkpoint's encoder (linked, not copied) under a modules.json of our choice;
    ``dense``: sentence-transformers Dense modules, saved by sentence-transformers itself."""
    source = default_model_folder()
    folder.mkdir(parents=True)
    for name in ENCODER_FILES:
        os.symlink(source / name, folder / name)
    pooling = {"word_embedding_dimension": 384, **{FLAGS[mode]: mode in modes for mode in POOLING_MODES}}
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    modules = [_module(0, "Transformer", ""), _module(1, "Pooling", "1_Pooling")]
    for layer in dense:
        path = f"{len(modules)}_Dense"
        (folder / path).mkdir()
        layer.save(str(folder / path))
        modules.append(_module(len(modules), "Dense", path))
    if normalize:
        modules.append(_module(len(modules), "Normalize", f"{len(modules)}_Normalize"))
    (folder / "modules.json").write_text(json.dumps(modules))
    return folder


def reference_embeddings(folder: Path) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    return model.encode(SENTENCES, convert_to_numpy=True, batch_size=len(SENTENCES))


def cosines(ours: np.ndarray, expected: np.ndarray) -> np.ndarray:
    return (ours * expected).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(expected, axis=1))


def _compile(folder: Path, cache_dir: Path, pooling: tuple[str, ...] | None = None) -> Engine:
    request = CompileRequest(model=str(folder), max_batch=MAX_BATCH, pooling=pooling)
    return Engine(load_artifact(compile_artifact(request, cache_dir)))


@pytest.fixture(scope="module")
def all_modes_engine(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Engine:
    """A mean-pooled folder compiled with --pooling naming every mode."""
    folder = sentence_transformers_folder(tmp_path_factory.mktemp("st") / "mean", ("mean",))
    return _compile(folder, cache_dir, pooling=POOLING_MODES)


@pytest.fixture(scope="module")
def all_modes_output(all_modes_engine: Engine) -> np.ndarray:
    return Embedder(all_modes_engine).embed(SENTENCES)


def test_pooling_override_is_recorded(all_modes_engine: Engine) -> None:
    manifest = all_modes_engine.artifact.manifest
    assert manifest.pooling["modes"] == list(POOLING_MODES)
    assert all_modes_engine.embedding_size == len(POOLING_MODES) * 384
    assert all_modes_engine.output_shapes["sentence_embedding"] == (-1, len(POOLING_MODES) * 384)


def test_concatenated_modes_match_sentence_transformers(all_modes_output: np.ndarray, tmp_path: Path) -> None:
    expected = reference_embeddings(sentence_transformers_folder(tmp_path / "all", POOLING_MODES))
    assert all_modes_output.shape == expected.shape
    assert cosines(all_modes_output, expected).min() >= 0.99999
    np.testing.assert_allclose(all_modes_output, expected, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("mode", POOLING_MODES)
def test_each_mode_matches_sentence_transformers(mode: str, all_modes_output: np.ndarray, tmp_path: Path) -> None:
    """Each mode's slice of the concatenation against sentence-transformers with that mode alone."""
    start = POOLING_MODES.index(mode) * 384
    ours = all_modes_output[:, start:start + 384]
    expected = reference_embeddings(sentence_transformers_folder(tmp_path / mode, (mode,)))
    assert cosines(ours, expected).min() >= 0.99999
    np.testing.assert_allclose(ours, expected, rtol=1e-3, atol=1e-4)


def test_modes_follow_the_mask_as_sentence_transformers_does(all_modes_engine: Engine) -> None:
    """Left padding, right padding and a row with no attended token, against
    sentence-transformers' own Pooling module run on our last_hidden_state."""
    import torch
    from sentence_transformers.sentence_transformer.modules import Pooling

    ids = np.random.default_rng(0).integers(1000, 30000, (4, 12))
    mask = np.ones_like(ids)
    mask[1, :4] = 0
    mask[2, 7:] = 0
    mask[3, :] = 0
    ours = all_modes_engine.run(ids, mask)
    features = {"token_embeddings": torch.from_numpy(ours.last_hidden_state), "attention_mask": torch.from_numpy(mask)}
    expected = Pooling(384, pooling_mode=POOLING_MODES)(features)["sentence_embedding"].numpy()
    np.testing.assert_allclose(ours.sentence_embedding, expected, rtol=1e-5, atol=1e-5)


def test_dense_and_normalize_match_sentence_transformers(tmp_path: Path, cache_dir: Path) -> None:
    import torch
    from sentence_transformers.base.modules import Dense

    torch.manual_seed(0)
    dense = (Dense(384, 256, activation_function=torch.nn.Tanh()),
             Dense(256, 96, bias=False, activation_function=torch.nn.Identity()))
    folder = sentence_transformers_folder(tmp_path / "dense", ("mean",), dense, normalize=True)
    engine = _compile(folder, cache_dir)
    assert engine.embedding_size == 96
    assert [d["activation"] for d in engine.artifact.manifest.pooling["dense"]] == ["tanh", "identity"]
    ours = Embedder(engine).embed(SENTENCES)
    expected = reference_embeddings(folder)
    assert cosines(ours, expected).min() >= 0.99999
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
