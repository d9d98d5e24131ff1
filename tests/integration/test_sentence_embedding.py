"""Sentence embeddings agree with the checkpoint's own pooling recipe (sentence-transformers
modules: masked mean over tokens, then L2 normalisation) computed with transformers."""

from __future__ import annotations

import functools
import json

import numpy as np

from dietserve.model.presets import default_model_folder
from dietserve.runtime.embedder import Embedder

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "Two men pushed carts through the woods.",
    "Compilers for dynamic shapes tune micro-kernels once and dispatch each sequence length.",
]


def _reference_embeddings(reference, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    import torch
    from transformers import AutoTokenizer

    folder = default_model_folder()
    pooling = json.loads((folder / "1_Pooling" / "config.json").read_text())
    assert pooling["pooling_mode_mean_tokens"], "the reference below implements mean pooling"
    modules = json.loads((folder / "modules.json").read_text())
    normalize = any(m["type"].endswith("Normalize") for m in modules)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = reference(**encoded).last_hidden_state
    mask = encoded["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    if normalize:
        pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
    return pooled.numpy(), encoded["input_ids"].numpy()


def test_embeddings_match_sentence_transformers_pooling(minilm_engine, minilm_reference) -> None:
    embedder = Embedder(minilm_engine)
    expected, expected_ids = _reference_embeddings(minilm_reference, SENTENCES)
    encoded = embedder.tokenizer.encode(SENTENCES)
    np.testing.assert_array_equal(encoded.input_ids, expected_ids)
    ours = embedder.embed(SENTENCES)
    cosine = (ours * expected).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(expected, axis=1))
    assert cosine.min() >= 0.9999, cosine
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


@functools.cache
def sentence_transformers_length() -> int:
    """Where sentence-transformers cuts the default model's texts: its own loader's reading of the
    checkpoint, not ours."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(default_model_folder()), device="cpu", local_files_only=True).max_seq_length


def test_long_texts_are_cut_where_sentence_transformers_cuts_them(minilm_engine) -> None:
    """all-MiniLM-L6-v2 holds 512 positions, but its authors' sentence-transformers recipe cuts a
    text at 256 tokens (``sentence_bert_config.json``), as TEI does: so does the text path."""
    from sentence_transformers import SentenceTransformer

    texts = [SENTENCES[0], " ".join(SENTENCES * 12)]  # the second: about 400 tokens
    embedder = Embedder(minilm_engine)
    assert embedder.tokenizer.max_length == sentence_transformers_length() < minilm_engine.max_seq_len
    assert embedder.tokenizer.encode(texts).input_ids.shape[1] == embedder.tokenizer.max_length
    expected = SentenceTransformer(str(default_model_folder()), device="cpu", local_files_only=True).encode(texts)
    np.testing.assert_allclose(embedder.embed(texts), expected, rtol=0, atol=1e-5)


def test_similar_sentences_score_higher(minilm_engine) -> None:
    ours = Embedder(minilm_engine).embed(SENTENCES[:3])
    similarity = ours @ ours.T
    assert similarity[0, 1] > similarity[0, 2]
