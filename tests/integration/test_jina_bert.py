"""JinaBERT (jina-embeddings-v2): BERT's layers with ALiBi for positions (each head's scores
biased by -slope * |distance|, no position table) and a gated MLP (``act(gate) * up`` from one
projection without bias, then the output projection and LayerNorm). transformers has no
JinaBERT, so the reference is transformers' BERT layers given ALiBi as their attention mask, each
layer's intermediate replaced by the gated one, saved under JinaBERT's names and config, with
every LayerNorm and bias varied. It compiles in both layouts and answers as the reference does
(every token, and the masked mean), at every length up to the last position; its sequence
classifier (jina-reranker-v1's) the reference's logits."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from dietserve.compile.artifact import CompileRequest, compile_artifact
from dietserve.model.checkpoint import Checkpoint, CheckpointError
from dietserve.model.presets import default_model_folder
from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.embedder import Embedder, artifact_tokenizer
from dietserve.runtime.engine import Engine

from .test_encoder_families import PAIRS, TEXTS

HIDDEN, HEADS, INTERMEDIATE, LENGTH = 48, 6, 80, 96
# ALiBi's slopes for 6 heads (the paper's rule: 2 ** (-8 i / 4) for the 4 of the largest power of
# two, then every other one of 8's series)
SLOPES = [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]


def _gated_intermediate():
    import torch

    class GatedIntermediate(torch.nn.Module):
        """JinaBERT's ``mlp.gated_layers`` and the GELU on its first half (the gate)."""

        def __init__(self):
            super().__init__()
            self.gated_layers = torch.nn.Linear(HIDDEN, 2 * INTERMEDIATE, bias=False)

        def forward(self, hidden):
            both = self.gated_layers(hidden)
            return torch.nn.functional.gelu(both[..., :INTERMEDIATE]) * both[..., INTERMEDIATE:]

    return GatedIntermediate()


def _saved_jina(folder: Path, model_class, architecture: str, **config_options):
    """``model_class`` (transformers' BERT or its sequence classifier) made JinaBERT's reference,
    saved in ``folder`` under JinaBERT's names and config (``architecture``) with the MiniLM
    checkpoint's tokenizer; returns the reference."""
    import torch
    from safetensors.torch import save_file
    from transformers import BertConfig

    folder.mkdir(parents=True)
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        if (default_model_folder() / name).is_file():
            shutil.copy(default_model_folder() / name, folder / name)
    config = BertConfig(vocab_size=30522, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
                        intermediate_size=INTERMEDIATE, max_position_embeddings=LENGTH, initializer_range=0.1,
                        **config_options)
    config._attn_implementation = "eager"  # (its scores take the mask as an additive bias)
    torch.manual_seed(53)
    model = model_class(config).eval()
    for layer in model.base_model.encoder.layer:
        layer.intermediate = _gated_intermediate()
    with torch.no_grad():
        model.base_model.embeddings.position_embeddings.weight.zero_()
        for name, parameter in model.named_parameters():
            if "LayerNorm" in name or name.endswith(".bias"):
                parameter.uniform_(-0.2, 0.2) if name.endswith(".bias") else parameter.uniform_(0.5, 1.5)
            elif "gated_layers" in name:
                parameter.normal_(0.0, 0.1)
    tensors = {re.sub(r"(layer\.\d+)\.output\.dense\.", r"\1.mlp.wo.", re.sub(
        r"(layer\.\d+)\.output\.LayerNorm\.", r"\1.mlp.layernorm.", name)).replace(".intermediate.", ".mlp."): value
        for name, value in model.state_dict().items() if "position" not in name}
    save_file({name: value.contiguous() for name, value in tensors.items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({
        **{key: getattr(config, key) for key in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
                                                 "num_attention_heads", "type_vocab_size", "layer_norm_eps")},
        "model_type": "bert", "architectures": [architecture],
        "position_embedding_type": "alibi", "feed_forward_type": "geglu", "hidden_act": "gelu",
        "max_position_embeddings": LENGTH, "pad_token_id": 0, **config_options,
        "auto_map": {"AutoConfig": "jinaai/jina-bert-implementation--configuration_bert.JinaBertConfig"}}))
    return model


def _alibi_mask(attention_mask: np.ndarray):
    """ALiBi with the padding masked: the additive mask transformers' eager attention takes."""
    import torch

    length = attention_mask.shape[1]
    alibi = -np.asarray(SLOPES)[:, None, None] * np.abs(np.arange(length)[None, :] - np.arange(length)[:, None])
    padding = np.where(attention_mask[:, None, None, :] == 1, 0.0, np.finfo(np.float32).min)
    return torch.from_numpy((alibi[None] + padding).astype(np.float32))


@pytest.fixture(scope="module")
def jina_folder(tmp_path_factory: pytest.TempPathFactory):
    """(the JinaBERT checkpoint's folder, the reference model)."""
    from transformers import BertModel

    folder = tmp_path_factory.mktemp("embedders") / "jina-bert"
    return folder, _saved_jina(folder, lambda config: BertModel(config, add_pooling_layer=False), "JinaBertModel")


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_jina_bert_matches_bert_layers_under_alibi(jina_folder, cache_dir: Path, layout: str) -> None:
    import torch

    folder, reference = jina_folder
    embedder = Embedder(Engine(load_artifact(compile_artifact(
        CompileRequest(model=str(folder), max_batch=8, layout=layout), cache_dir))))
    encoded = embedder.tokenizer.encode(TEXTS)
    assert encoded.input_ids.shape[1] == LENGTH and embedder.engine.packed == (layout == "packed")
    with torch.no_grad():
        expected = reference(input_ids=torch.from_numpy(encoded.input_ids),
                             token_type_ids=torch.from_numpy(encoded.token_type_ids),
                             attention_mask=_alibi_mask(encoded.attention_mask)).last_hidden_state.numpy()
    output = embedder.encode(TEXTS)
    mask = encoded.attention_mask[..., None]
    np.testing.assert_allclose(output.last_hidden_state * mask, expected * mask, rtol=0, atol=1e-4)
    mean = (expected * mask).sum(axis=1) / mask.sum(axis=1)
    np.testing.assert_allclose(output.sentence_embedding, mean, rtol=0, atol=1e-5)


def test_jina_bert_variants_not_compiled_are_refused_by_name(jina_folder, tmp_path: Path) -> None:
    folder = tmp_path / "variant"
    shutil.copytree(jina_folder[0], folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "feed_forward_type": "original"}))
    with pytest.raises(CheckpointError, match="feed_forward_type 'original'"):
        Checkpoint.open(folder)
    code = {"AutoConfig": "jinaai/jina-bert-v2-qk-post-norm--configuration_bert.JinaBertConfig"}
    (folder / "config.json").write_text(json.dumps({**raw, "auto_map": code}))
    with pytest.raises(CheckpointError, match="jina-bert-v2-qk-post-norm"):
        Checkpoint.open(folder)


def test_a_jina_reranker_matches_bert_layers_under_alibi(tmp_path: Path, cache_dir: Path) -> None:
    """JinaBertForSequenceClassification with one label (jina-reranker-v1's): BERT's pooler and
    classifier on JinaBERT's layers, its pairs' logits against the reference's."""
    import torch
    from transformers import BertForSequenceClassification

    folder = tmp_path / "jina-reranker"
    reference = _saved_jina(folder, BertForSequenceClassification, "JinaBertForSequenceClassification", num_labels=1)
    engine = Engine(load_artifact(compile_artifact(CompileRequest(model=str(folder), max_batch=8), cache_dir)))
    encoded = artifact_tokenizer(engine).encode(PAIRS)
    output = engine.run(encoded.input_ids, encoded.attention_mask, encoded.token_type_ids)
    with torch.no_grad():
        logits = reference(input_ids=torch.from_numpy(encoded.input_ids),
                           token_type_ids=torch.from_numpy(encoded.token_type_ids),
                           attention_mask=_alibi_mask(encoded.attention_mask)).logits.numpy()
    assert np.abs(logits).max() > 0.1 and (encoded.token_type_ids == 1).any()
    np.testing.assert_allclose(output.logits, logits, rtol=0, atol=1e-4)
