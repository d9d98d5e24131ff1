"""Qwen3, the decoder Qwen3-Embedding is, randomly initialised and saved by transformers under
sentence-transformers' last-token pooling and Normalize (Qwen3-Embedding's recipe): causal
attention, rotary positions, RMSNorm on the hidden state and on each head's queries and keys, a
gated SiLU, and key and value heads shared by pairs of query heads, each head wider than
hidden_size / heads. Gemma3's text model with bidirectional attention (EmbeddingGemma) under
mean pooling, a Dense module and Normalize (EmbeddingGemma's recipe): Qwen3's parts with
sliding-window layers beside full ones, norms after each block too, norms that scale by
``1 + weight``, a scaled embedding, a query scale of its own and a gated tanh GELU. Each compiles
in both layouts and answers as transformers and sentence-transformers do, at every length up to
the last position."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dietserve.compile.artifact import CompileRequest, compile_artifact
from dietserve.host.cpu import cpu_flags
from dietserve.model.checkpoint import Checkpoint, CheckpointError
from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.engine import Engine

from .server_process import ServerProcess
from .test_encoder_families import MAX_LENGTH, TEXTS, _embedder_matches, _tokenizer_folder


def _qwen3_config(tokenizer_folder: Path, **more):
    from transformers import AutoTokenizer, Qwen3Config

    return Qwen3Config(vocab_size=len(AutoTokenizer.from_pretrained(str(tokenizer_folder))), hidden_size=64,
                       intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, max_position_embeddings=MAX_LENGTH, initializer_range=0.1,
                       rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, pad_token_id=1,
                       bos_token_id=0, eos_token_id=2, **more)


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from sentence_transformers import SentenceTransformer, models
    from transformers import Qwen3Model

    decoder = _tokenizer_folder(tmp_path_factory.mktemp("qwen3-decoder"))
    torch.manual_seed(23)
    model = Qwen3Model(_qwen3_config(decoder)).eval()
    with torch.no_grad():  # (RMSNorm weights start at one: vary them, so that a norm's weight left out shows)
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    model.save_pretrained(str(decoder))
    transformer = models.Transformer(str(decoder), max_seq_length=MAX_LENGTH)
    folder = tmp_path_factory.mktemp("embedders") / "qwen3-embedder"
    SentenceTransformer(modules=[transformer, models.Pooling(transformer.get_embedding_dimension(), "lasttoken"),
                                 models.Normalize()], device="cpu").save(str(folder))
    return folder


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_qwen3_matches_transformers_and_sentence_transformers(qwen3_folder: Path, cache_dir: Path,
                                                               layout: str) -> None:
    from transformers import Qwen3Model

    reference = _embedder_matches(qwen3_folder, Qwen3Model, MAX_LENGTH, layout, cache_dir)
    assert reference.config.num_key_value_heads < reference.config.num_attention_heads
    assert reference.config.head_dim * reference.config.num_attention_heads != reference.config.hidden_size


@pytest.fixture(scope="module")
def gemma3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from sentence_transformers import SentenceTransformer, models
    from transformers import AutoTokenizer, Gemma3TextConfig, Gemma3TextModel

    decoder = _tokenizer_folder(tmp_path_factory.mktemp("gemma3-decoder"))
    # A window of 6 (transformers: keys at most 3 away) in two layers of three; a query scale of 24, not
    # 32; 3 query heads over one key and value head, as EmbeddingGemma's (on 2 cores: query parts)
    config = Gemma3TextConfig(
        vocab_size=len(AutoTokenizer.from_pretrained(str(decoder))), hidden_size=48, intermediate_size=96,
        num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24,
        max_position_embeddings=MAX_LENGTH, sliding_window=6, use_bidirectional_attention=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], initializer_range=0.1,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        pad_token_id=1, bos_token_id=0, eos_token_id=2)
    torch.manual_seed(31)
    model = Gemma3TextModel(config).eval()
    with torch.no_grad():  # (Gemma's norms scale by 1 + weight, zero at first: vary them)
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(-0.5, 0.5)
    model.save_pretrained(str(decoder))
    transformer = models.Transformer(str(decoder), max_seq_length=MAX_LENGTH)
    folder = tmp_path_factory.mktemp("embedders") / "gemma3-embedder"
    dense = models.Dense(48, 40, bias=False, activation_function=torch.nn.Identity())
    SentenceTransformer(modules=[transformer, models.Pooling(48, "mean"), dense, models.Normalize()],
                        device="cpu").save(str(folder))
    return folder


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_gemma3_matches_transformers_and_sentence_transformers(gemma3_folder: Path, cache_dir: Path,
                                                                layout: str) -> None:
    from transformers import Gemma3TextModel

    reference = _embedder_matches(gemma3_folder, Gemma3TextModel, MAX_LENGTH, layout, cache_dir)
    assert set(reference.config.layer_types) == {"sliding_attention", "full_attention"}


def test_a_causal_gemma3_is_refused_by_name(gemma3_folder: Path, tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "generator"
    shutil.copytree(gemma3_folder, folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "use_bidirectional_attention": False}))
    with pytest.raises(CheckpointError, match="use_bidirectional_attention=true"):
        Checkpoint.open(folder)


def test_a_qwen3_sequence_classifier_is_refused_by_name(qwen3_folder: Path, tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "classifier"
    shutil.copytree(qwen3_folder, folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "architectures": ["Qwen3ForSequenceClassification"]}))
    with pytest.raises(CheckpointError, match=r"a qwen3 sequence classifier \(Qwen3ForSequenceClass"):
        Checkpoint.open(folder)


@pytest.mark.slow
def test_a_server_answers_openai_embeddings_from_qwen3(qwen3_folder: Path, cache_dir: Path) -> None:
    """Qwen3-Embedding's clients ask through OpenAI's API: a real server, its real client."""
    from openai import OpenAI
    from sentence_transformers import SentenceTransformer

    artifact = compile_artifact(CompileRequest(model=str(qwen3_folder), max_batch=8, analytic=True), cache_dir)
    server = ServerProcess(None, "--artifact", str(artifact), model_name=None)
    try:
        client = OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused")
        answer = client.embeddings.create(model="qwen3-embedder", input=TEXTS, encoding_format="float",
                                          extra_body={"truncate": True})
        expected = SentenceTransformer(str(qwen3_folder), device="cpu", local_files_only=True).encode(TEXTS)
        np.testing.assert_allclose([row.embedding for row in answer.data], expected, rtol=0, atol=1e-4)
    finally:
        server.stop()


@pytest.mark.skipif("avx512_bf16" not in (cpu_flags() or set()), reason="this CPU has no AVX512-BF16")
def test_qwen3_bf16_keeps_the_accuracy_contract(tmp_path: Path, cache_dir: Path) -> None:
    """A bf16 build (heads of 64, so attention runs on bf16 pairs) against transformers in fp32,
    at lengths up to 512 (random tokens): every token within cosine 0.9999, every mean-pooled
    sentence within 0.99995, as ``test_bf16_model.py`` holds MiniLM and bert-base."""
    import torch
    from transformers import Qwen3Config, Qwen3Model

    from .test_bf16_model import check_random_tokens

    folder = tmp_path / "qwen3-bf16"
    config = Qwen3Config(vocab_size=30522, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, pad_token_id=0)
    torch.manual_seed(29)
    reference = Qwen3Model(config).eval()
    reference.save_pretrained(str(folder))
    request = CompileRequest(model=str(folder), max_batch=8, analytic=True, precision="bf16")
    engine = Engine(load_artifact(compile_artifact(request, cache_dir)))
    assert engine.artifact.manifest.precision == "bf16"
    check_random_tokens(engine, reference, seed=5)
