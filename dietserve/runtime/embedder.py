"""Sentences in, embeddings out: the artifact's tokenizer in front of the engine."""

from __future__ import annotations

import numpy as np

from ..model.tokenizer import TextTokenizer
from .engine import EncoderOutput, Engine


def artifact_tokenizer(engine: Engine) -> TextTokenizer:
    """The artifact's tokenizer, truncating at the engine's maximum length, numbering token types
    only where the model has more than one."""
    return TextTokenizer.from_folder(engine.artifact.directory, engine.max_seq_len, engine.type_vocab_size > 1)


class Embedder:
    def __init__(self, engine: Engine):
        if engine.is_classifier:
            raise ValueError(f"{engine.artifact.directory} is a classifier (cross-encoder): it scores texts and pairs "
                             "instead of embedding them; serve it and use /rerank or /predict")
        self.engine = engine
        self.tokenizer = artifact_tokenizer(engine)

    def encode(self, texts: list[str]) -> EncoderOutput:
        """Runs in chunks of the artifact's maximum batch."""
        chunks = []
        for start in range(0, len(texts), self.engine.max_batch):
            encoded = self.tokenizer.encode(texts[start : start + self.engine.max_batch])
            chunks.append(self.engine.run(encoded.input_ids, encoded.attention_mask, encoded.token_type_ids))
        if len(chunks) == 1:
            return chunks[0]
        width = max(chunk.last_hidden_state.shape[1] for chunk in chunks)
        padded = [
            np.pad(chunk.last_hidden_state, ((0, 0), (0, width - chunk.last_hidden_state.shape[1]), (0, 0)))
            for chunk in chunks
        ]
        return EncoderOutput(np.concatenate(padded), np.concatenate([c.sentence_embedding for c in chunks]))

    def embed(self, texts: list[str]) -> np.ndarray:
        return self.encode(texts).sentence_embedding


def cosine_similarities(embeddings: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(embeddings, axis=1, keepdims=True)
    unit = embeddings / np.maximum(norms, 1e-12)
    return unit @ unit.T
