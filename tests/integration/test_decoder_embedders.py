"""Qwen3, the decoder Qwen3-Embedding is, randomly initialised and saved by transformers under
sentence-transformers' last-token pooling and Normalize (Qwen3-Embedding's recipe): causal
attention, rotary positions, RMSNorm on the hidden state and on each head's queries and keys, a
gated SiLU, and key and value heads shared by pairs of query heads, each head wider than
hidden_size / heads. Gemma3's text model with bidirectional attention (EmbeddingGemma) under
mean pooling, a Dense module and Normalize (EmbeddingGemma's recipe): Qwen3's parts with
sliding-window layers beside full ones, norms after each block too, norms that scale by
``1 + weight``, a scaled embedding, a query scale of its own and a gated tanh GELU. Each compiles
in both layouts and answers as transformers and sentence-transformers do, at every length up to
the last position. The decoders built as Qwen3 without its norms on each head: Qwen2 (biases on
its query, key and value projections; causal, or bidirectional as gte-Qwen2-7B-instruct is),
Mistral (a causal sliding window, e5-mistral's recipe) and Llama."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dietserve.compile.artifact import CompileRequest, compile_artifact
from dietserve.host.cpu import cpu_flags
from dietserve.model.checkpoint import Checkpoint, CheckpointError
from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.embedder import Embedder
from dietserve.runtime.engine import Engine

from .server_process import ServerProcess
from .test_encoder_families import MAX_LENGTH, TEXTS, _embedder_matches, _tokenizer_folder


def _qwen3_config(tokenizer_folder: Path, **more):
    from transformers import AutoTokenizer, Qwen3Config

    return Qwen3Config(vocab_size=len(AutoTokenizer.from_pretrained(str(tokenizer_folder))), hidden_size=64,
                       intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, max_position_embeddings=MAX_LENGTH, initializer_range=0.1,
                       rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                       **{"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, **more})


def _saved_embedder(tmp_path_factory: pytest.TempPathFactory, name: str, model_class, config,
                    pooling: str, seed: int) -> Path:
    """``model_class(config)`` randomly initialised (its RMSNorm weights, which start at one,
    and its biases, which start at zero, varied so that one left out shows), saved by
    transformers, under sentence-transformers' ``pooling`` and Normalize."""
    import torch
    from sentence_transformers import SentenceTransformer, models

    decoder = tmp_path_factory.mktemp(f"{name}-decoder")
    torch.manual_seed(seed)
    model = model_class(config(_tokenizer_folder(decoder))).eval()
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "norm" in parameter_name:
                parameter.uniform_(0.5, 1.5)
            elif parameter_name.endswith(".bias"):
                parameter.uniform_(-0.2, 0.2)
    model.save_pretrained(str(decoder))
    transformer = models.Transformer(str(decoder), max_seq_length=MAX_LENGTH)
    folder = tmp_path_factory.mktemp("embedders") / f"{name}-embedder"
    SentenceTransformer(modules=[transformer, models.Pooling(transformer.get_embedding_dimension(), pooling),
                                 models.Normalize()], device="cpu").save(str(folder))
    return folder


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen3Model

    return _saved_embedder(tmp_path_factory, "qwen3", Qwen3Model, _qwen3_config, "lasttoken", 23)


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


def test_a_gemma3_sequence_classifier_is_refused_by_name(gemma3_folder: Path, tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "classifier"
    shutil.copytree(gemma3_folder, folder)
    raw = json.loads((folder / "config.json").read_text())
    architecture = {"architectures": ["Gemma3TextForSequenceClassification"]}
    (folder / "config.json").write_text(json.dumps({**raw, **architecture}))
    with pytest.raises(CheckpointError, match=r"a gemma3_text sequence classifier \(Gemma3TextForSequenceClass"):
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


def _vocabulary(tokenizer_folder: Path) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(tokenizer_folder)))


def _qwen2_config(tokenizer_folder: Path, **more):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=_vocabulary(tokenizer_folder), hidden_size=64, intermediate_size=96,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=MAX_LENGTH, initializer_range=0.1,
                       rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, pad_token_id=1,
                       bos_token_id=0, eos_token_id=2, **more)


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Saved as ``Qwen2ForCausalLM`` (its encoder under ``model.``, an ``lm_head`` beside it), as
    a causal Qwen2 embedder fine-tuned from a generator is."""
    from transformers import Qwen2ForCausalLM

    return _saved_embedder(tmp_path_factory, "qwen2", Qwen2ForCausalLM, _qwen2_config, "lasttoken", 37)


def test_qwen2_matches_transformers_and_sentence_transformers(qwen2_folder: Path, cache_dir: Path) -> None:
    from transformers import Qwen2Model

    reference = _embedder_matches(qwen2_folder, Qwen2Model, MAX_LENGTH, "packed", cache_dir)
    assert np.abs(reference.layers[0].self_attn.k_proj.bias.detach().numpy()).max() > 0.01


def test_a_bidirectional_qwen2_matches_transformers_layers_unmasked(qwen2_folder: Path, cache_dir: Path,
                                                                     tmp_path: Path) -> None:
    """gte-Qwen2-7B-instruct's attention reads every token (``is_causal`` false): transformers'
    Qwen2 layers given a mask of the padding alone, and their last token's state normalised
    (sentence-transformers would run them causal)."""
    import shutil

    import torch
    from transformers import AutoTokenizer, Qwen2Model

    folder = tmp_path / "gte-qwen2"
    shutil.copytree(qwen2_folder, folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "is_causal": False}))
    embedder = Embedder(Engine(load_artifact(compile_artifact(
        CompileRequest(model=str(folder), max_batch=8), cache_dir))))
    reference = Qwen2Model.from_pretrained(str(qwen2_folder), attn_implementation="eager").eval()
    encoded = AutoTokenizer.from_pretrained(str(folder))(TEXTS, padding=True, truncation=True, max_length=MAX_LENGTH,
                                                         return_tensors="pt")
    keys = encoded["attention_mask"][:, None, None, :].expand(-1, 1, MAX_LENGTH, -1)
    unmasked = torch.zeros(keys.shape).masked_fill(keys == 0, torch.finfo(torch.float32).min)
    with torch.no_grad():
        expected = reference(input_ids=encoded["input_ids"],
                             attention_mask={"full_attention": unmasked}).last_hidden_state.numpy()
        causal = reference(**encoded).last_hidden_state.numpy()
    output = embedder.encode(TEXTS)
    mask = encoded["attention_mask"].numpy()[..., None]
    assert np.abs((causal - expected) * mask).max() > 0.1  # (the two attentions differ here)
    np.testing.assert_allclose(output.last_hidden_state * mask, expected * mask, rtol=0, atol=1e-4)
    last = expected[np.arange(len(TEXTS)), mask[..., 0].sum(axis=1) - 1]
    np.testing.assert_allclose(output.sentence_embedding, last / np.linalg.norm(last, axis=1, keepdims=True),
                               rtol=0, atol=1e-5)


def test_a_qwen2_with_its_own_modeling_code_must_say_whether_it_is_causal(qwen2_folder: Path,
                                                                          tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "custom"
    shutil.copytree(qwen2_folder, folder)
    raw = json.loads((folder / "config.json").read_text())
    custom = {**raw, "auto_map": {"AutoModel": "modeling_qwen.Qwen2Model"}}
    (folder / "config.json").write_text(json.dumps(custom))
    with pytest.raises(CheckpointError, match=r"modeling_qwen\.Qwen2Model.*add \"is_causal\": false or true"):
        Checkpoint.open(folder)
    (folder / "config.json").write_text(json.dumps({**custom, "is_causal": True}))
    assert Checkpoint.open(folder).config.causal


MISTRAL_WINDOW = 6  # transformers: the query and the 5 keys before it, so texts here reach past it


@pytest.fixture(scope="module")
def mistral_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import MistralConfig, MistralModel

    def config(tokenizer_folder: Path):
        return MistralConfig(vocab_size=_vocabulary(tokenizer_folder), hidden_size=64, intermediate_size=96,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                             max_position_embeddings=MAX_LENGTH, sliding_window=MISTRAL_WINDOW,
                             initializer_range=0.1, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
                             pad_token_id=1, bos_token_id=0, eos_token_id=2)

    return _saved_embedder(tmp_path_factory, "mistral", MistralModel, config, "lasttoken", 41)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_mistral_matches_transformers_and_sentence_transformers(mistral_folder: Path, cache_dir: Path,
                                                                 layout: str) -> None:
    from transformers import MistralModel

    reference = _embedder_matches(mistral_folder, MistralModel, MAX_LENGTH, layout, cache_dir)
    assert reference.config.sliding_window == MISTRAL_WINDOW


def test_llama_matches_transformers_and_sentence_transformers(tmp_path_factory: pytest.TempPathFactory,
                                                               cache_dir: Path) -> None:
    """Llama with biases on its attention's projections (``attention_bias``), under mean pooling."""
    from transformers import LlamaConfig, LlamaModel

    def config(tokenizer_folder: Path):
        return LlamaConfig(vocab_size=_vocabulary(tokenizer_folder), hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           max_position_embeddings=MAX_LENGTH, attention_bias=True, initializer_range=0.1,
                           rope_parameters={"rope_type": "default", "rope_theta": 500_000.0}, pad_token_id=1,
                           bos_token_id=0, eos_token_id=2)

    folder = _saved_embedder(tmp_path_factory, "llama", LlamaModel, config, "mean", 43)
    reference = _embedder_matches(folder, LlamaModel, MAX_LENGTH, "packed", cache_dir)
    assert np.abs(reference.layers[0].self_attn.o_proj.bias.detach().numpy()).max() > 0.01


def test_a_llama_with_mlp_biases_is_refused_by_name(mistral_folder: Path, tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "llama"
    shutil.copytree(mistral_folder, folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "model_type": "llama", "mlp_bias": True}))
    with pytest.raises(CheckpointError, match="mlp_bias=true is not supported for llama"):
        Checkpoint.open(folder)
