"""A BertForSequenceClassification checkpoint (a cross-encoder) compiles through the same
pipeline and its logits match transformers and sentence-transformers' CrossEncoder on real
sentence pairs (two segments: token_type_ids 0 and 1)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from dietserve.compile.artifact import CompileRequest, compile_artifact
from dietserve.model.presets import default_model_folder
from dietserve.model.tokenizer import TOKENIZER_FILES
from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.engine import Engine

from .reference import as_layout_answers

PAIRS = [
    ("How many people live in Berlin?", "Berlin has a population of 3,520,031 registered inhabitants."),
    ("How many people live in Berlin?", "New York City is famous for the Metropolitan Museum of Art."),
    ("A man is eating food.", "A man is eating a piece of bread."),
    ("The girl is carrying a baby.", "Two men pushed carts through the woods."),
    ("What does a compiler for dynamic shapes tune?", "Micro-kernels, once, then it dispatches each length."),
]
LABELS = {3: {0: "contradiction", 1: "entailment", 2: "neutral"}, 1: {0: "relevance"}}


def classification_folder(folder: Path, num_labels: int) -> Path:
    """A small randomly initialised BertForSequenceClassification (fixed seed), saved by
    transformers, with the default checkpoint's tokenizer. The wider initialisation puts the
    logits at O(1), where a wrong pooler or classifier cannot hide under the tolerance."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128, initializer_range=0.1,
                        id2label=LABELS[num_labels], label2id={v: k for k, v in LABELS[num_labels].items()})
    torch.manual_seed(7)
    BertForSequenceClassification(config).eval().save_pretrained(str(folder))
    for name in TOKENIZER_FILES:
        if (default_model_folder() / name).is_file():
            shutil.copy(default_model_folder() / name, folder / name)
    return folder


@pytest.fixture(scope="module", params=[3, 1], ids=["3 labels", "1 label"])
def classifier(request, tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> tuple[Path, Engine]:
    folder = classification_folder(tmp_path_factory.mktemp("cross-encoder") / "model", request.param)
    artifact = compile_artifact(CompileRequest(model=str(folder), max_batch=8), cache_dir)
    return folder, Engine(load_artifact(artifact))


def _encoded(folder: Path) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return tokenizer([a for a, _ in PAIRS], [b for _, b in PAIRS], padding=True, return_tensors="np")


def test_logits_match_transformers(classifier) -> None:
    import torch
    from transformers import BertForSequenceClassification

    folder, engine = classifier
    encoded = _encoded(folder)
    assert set(np.unique(encoded["token_type_ids"])) == {0, 1}
    output = engine.run(encoded["input_ids"], encoded["attention_mask"], encoded["token_type_ids"])
    reference = BertForSequenceClassification.from_pretrained(str(folder), attn_implementation="eager").eval()
    with torch.no_grad():
        expected = reference(**{k: torch.from_numpy(v) for k, v in encoded.items()}, output_hidden_states=True)
    assert output.sentence_embedding is None
    assert np.abs(output.logits).max() > 0.1  # logits far from zero, so the tolerance below is tight
    np.testing.assert_allclose(output.logits, expected.logits.numpy(), rtol=0, atol=1e-4)
    hidden = as_layout_answers(engine, expected.hidden_states[-1].numpy(), encoded["attention_mask"])
    np.testing.assert_allclose(output.last_hidden_state, hidden, rtol=0, atol=1e-4)


def test_scores_match_cross_encoder(classifier) -> None:
    """CrossEncoder.predict applies its documented default activation: a sigmoid with one label,
    the logits as they are with several."""
    from sentence_transformers import CrossEncoder

    folder, engine = classifier
    encoded = _encoded(folder)
    logits = engine.run(encoded["input_ids"], encoded["attention_mask"], encoded["token_type_ids"]).logits
    scores = CrossEncoder(str(folder), device="cpu", local_files_only=True).predict(PAIRS, convert_to_numpy=True)
    expected_ours = 1 / (1 + np.exp(-logits[:, 0])) if logits.shape[1] == 1 else logits
    np.testing.assert_allclose(expected_ours, scores, rtol=0, atol=1e-4)


def test_manifest_records_the_task_and_labels(classifier) -> None:
    _, engine = classifier
    labels = LABELS[len(engine.labels)]
    manifest = engine.artifact.manifest
    assert manifest.task == engine.task == "classification"
    assert manifest.classifier == {"num_labels": len(labels), "id2label": {str(k): v for k, v in labels.items()}}
    assert engine.labels == tuple(labels[i] for i in range(len(labels)))
    assert engine.output_shapes == {"last_hidden_state": (-1, -1, 64), "logits": (-1, len(labels))}
    assert manifest.outputs == ["last_hidden_state", "logits"] and manifest.pooling is None
