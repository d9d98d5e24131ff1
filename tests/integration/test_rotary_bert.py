"""BERT's post-LayerNorm layers with rotary attention and a gated MLP, each family randomly
initialised and saved by transformers under sentence-transformers' pooling and Normalize.

NomicBERT (nomic-embed-text's encoder, mean pooling): rotary positions, a gated SiLU and no linear
biases. transformers saves its weights under the original
checkpoints' names (nomic-embed-text's on the Hub: a fused ``attn.Wqkv``, ``mlp.fc11``/``fc12``/
``fc2``, ``norm1``/``norm2``, ``emb_ln``). It compiles in both layouts from transformers' config,
from the original checkpoints' config keys (GPT-2-style: ``n_embd``, ``rotary_emb_base``, ...)
and from weights under transformers' module names, and answers as transformers and
sentence-transformers do.

GTE (gte-multilingual-base's, CLS pooling): biases but on the gate and up projections, a gated
GELU, with and without token types (gte-base-en-v1.5 has none); from transformers' config and
from the original checkpoints' (model_type ``new``), also with gte-*-en-v1.5's NTK-scaled
rotation. A sequence classifier of either (a reranker: gte-multilingual-reranker-base's head)
scores as transformers and CrossEncoder do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dietserve.model.checkpoint import Checkpoint, CheckpointError

from .test_encoder_families import MAX_LENGTH, _embedder_matches, _tokenizer_folder


def _saved_embedder(factory: pytest.TempPathFactory, family: str, pooling: str, seed: int, **config) -> Path:
    """A random transformers ``{family}Model`` of the small sizes every test here uses, its norms
    and biases varied (they start at one and zero: one left out would not show), saved under
    sentence-transformers' ``pooling`` and Normalize."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer, models

    encoder = _tokenizer_folder(factory.mktemp(f"{family}-encoder"))
    model_class = getattr(transformers, f"{family}Model")
    sizes = {"vocab_size": len(transformers.AutoTokenizer.from_pretrained(str(encoder))), "hidden_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96,
             "max_position_embeddings": MAX_LENGTH, "pad_token_id": 1, "initializer_range": 0.1}
    torch.manual_seed(seed)
    model = model_class(model_class.config_class(**sizes, **config)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                parameter.uniform_(-0.5, 1.5)
    model.save_pretrained(str(encoder))
    transformer = models.Transformer(str(encoder), max_seq_length=MAX_LENGTH)
    folder = factory.mktemp("embedders") / f"{family}-embedder"
    SentenceTransformer(modules=[transformer, models.Pooling(64, pooling), models.Normalize()],
                        device="cpu").save(str(folder))
    return folder


@pytest.fixture(scope="module")
def nomic_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _saved_embedder(tmp_path_factory, "NomicBert", "mean", 37,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000.0})


def _as_original(folder: Path, out: Path) -> Path:
    """``folder`` with the original checkpoints' config keys (its weights transformers saves
    under the original names already: ``attn.Wqkv``, ``mlp.fc11``, ``norm1``, ``emb_ln``, ...)."""
    shutil.copytree(folder, out)
    raw = json.loads((folder / "config.json").read_text())
    original = {"model_type": "nomic_bert", "architectures": ["NomicBertModel"], "n_embd": raw["hidden_size"],
                "n_head": raw["num_attention_heads"], "n_layer": raw["num_hidden_layers"],
                "n_inner": raw["intermediate_size"], "n_positions": raw["max_position_embeddings"],
                "layer_norm_epsilon": raw["layer_norm_eps"], "vocab_size": raw["vocab_size"],
                "type_vocab_size": raw["type_vocab_size"], "rotary_emb_base": raw["rope_parameters"]["rope_theta"],
                "activation_function": "swiglu", "prenorm": False, "rotary_emb_fraction": 1.0,
                "rotary_emb_interleaved": False, "rotary_scaling_factor": None, "max_trained_positions": 2048,
                "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False, "causal": False,
                "pad_token_id": raw["pad_token_id"]}
    (out / "config.json").write_text(json.dumps(original))
    return out


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_nomic_bert_matches_transformers_and_sentence_transformers(nomic_folder: Path, cache_dir: Path,
                                                                    layout: str) -> None:
    from transformers import NomicBertModel

    reference = _embedder_matches(nomic_folder, NomicBertModel, MAX_LENGTH, layout, cache_dir)
    assert reference.config.hidden_act == "silu" and not reference.layers[0].self_attn.q_proj.bias


def _original_matches(folder: Path, original: Path, saved_name: str, model_class, cache_dir: Path) -> None:
    """``original`` (``folder`` with the original config keys) reads as ``folder``'s config and
    answers as transformers reads ``folder``; ``saved_name``: a name transformers saves under the
    original names, as the Hub's checkpoints have them."""
    from safetensors.torch import load_file

    assert saved_name in load_file(str(folder / "model.safetensors"))
    assert Checkpoint.open(original).config == Checkpoint.open(folder).config
    _embedder_matches(original, model_class, MAX_LENGTH, "packed", cache_dir, reference_folder=folder)


def test_an_original_nomic_config_matches_transformers(nomic_folder: Path, tmp_path: Path, cache_dir: Path) -> None:
    from transformers import NomicBertModel

    _original_matches(nomic_folder, _as_original(nomic_folder, tmp_path / "original"),
                      "encoder.layers.0.attn.Wqkv.weight", NomicBertModel, cache_dir)


def test_weights_under_transformers_module_names_load_alike(nomic_folder: Path, tmp_path: Path,
                                                            cache_dir: Path) -> None:
    """transformers holds NomicBERT's weights under its own module names (``layers.N.self_attn.q_proj``)
    and saves them under the original ones; a file written from its state dict holds the former."""
    from safetensors.torch import save_file
    from transformers import NomicBertModel

    folder = tmp_path / "module-names"
    shutil.copytree(nomic_folder, folder)
    state = NomicBertModel.from_pretrained(str(nomic_folder)).state_dict()
    assert "layers.0.self_attn.q_proj.weight" in state
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(folder / "model.safetensors"))
    _embedder_matches(folder, NomicBertModel, MAX_LENGTH, "packed", cache_dir, reference_folder=nomic_folder)


@pytest.mark.parametrize("key,value", [("prenorm", True), ("rotary_emb_interleaved", True),
                                       ("rotary_emb_fraction", 0.5), ("qkv_proj_bias", True),
                                       ("moe_every_n_layers", 2), ("activation_function", "gelu")])
def test_original_options_we_do_not_compile_are_refused_by_name(nomic_folder: Path, tmp_path: Path, key: str,
                                                                value) -> None:
    original = _as_original(nomic_folder, tmp_path / "original")
    raw = json.loads((original / "config.json").read_text())
    (original / "config.json").write_text(json.dumps({**raw, key: value}))
    with pytest.raises(CheckpointError, match=f"{key}={value!r} is not supported for nomic_bert"):
        Checkpoint.open(original)


@pytest.mark.parametrize("family", ["GteForSequenceClassification", "NomicBertForSequenceClassification"])
def test_a_reranker_scores_as_transformers_and_cross_encoder(family: str, tmp_path: Path, cache_dir: Path) -> None:
    """A sequence classifier with one label (gte-multilingual-reranker-base's head: BERT's pooler,
    a dense layer and tanh on the first token, then the output layer)."""
    import torch
    import transformers

    from dietserve.compile.artifact import CompileRequest, compile_artifact
    from dietserve.runtime.artifact import load_artifact
    from dietserve.runtime.engine import Engine

    from .test_encoder_families import cross_encoder_matches

    model_class = getattr(transformers, family)
    folder = _tokenizer_folder(tmp_path / "reranker")
    config = model_class.config_class(
        vocab_size=len(transformers.AutoTokenizer.from_pretrained(str(folder))), hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=96, max_position_embeddings=MAX_LENGTH, pad_token_id=1,
        initializer_range=0.1, num_labels=1)
    torch.manual_seed(43)
    model_class(config).eval().save_pretrained(str(folder))
    engine = Engine(load_artifact(compile_artifact(CompileRequest(model=str(folder), max_batch=8), cache_dir)))
    cross_encoder_matches(folder, engine, model_class)


@pytest.fixture(scope="module", params=[1, 0], ids=["token-types", "no-token-types"])
def gte_folder(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _saved_embedder(tmp_path_factory, "Gte", "cls", 41, type_vocab_size=request.param,
                           rope_parameters={"rope_type": "default", "rope_theta": 160_000.0})


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_gte_matches_transformers_and_sentence_transformers(gte_folder: Path, cache_dir: Path, layout: str) -> None:
    from transformers import GteModel

    reference = _embedder_matches(gte_folder, GteModel, MAX_LENGTH, layout, cache_dir)
    attention = reference.layers[0].self_attn
    assert attention.q_proj.bias is not None and reference.layers[0].mlp.gate_proj.bias is None


def _gte_as_original(folder: Path, out: Path, **changes) -> Path:
    """``folder`` with the original checkpoints' config (model_type ``new``, the keys of
    gte-multilingual-base's config.json); its weights transformers saves under their names already."""
    shutil.copytree(folder, out)
    raw = json.loads((folder / "config.json").read_text())
    original = {**{key: raw[key] for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                             "intermediate_size", "hidden_act", "max_position_embeddings",
                                             "type_vocab_size", "layer_norm_eps", "vocab_size", "pad_token_id")},
                "model_type": "new", "architectures": ["NewModel"], "position_embedding_type": "rope",
                "rope_theta": raw["rope_parameters"]["rope_theta"], "rope_scaling": None,
                "layer_norm_type": "layer_norm", "logn_attention_scale": False, "logn_attention_clip1": False,
                "pack_qkv": True, "unpad_inputs": False, "use_memory_efficient_attention": False, **changes}
    (out / "config.json").write_text(json.dumps(original))
    return out


def test_an_original_gte_config_matches_transformers(gte_folder: Path, tmp_path: Path, cache_dir: Path) -> None:
    from transformers import GteModel

    _original_matches(gte_folder, _gte_as_original(gte_folder, tmp_path / "original"),
                      "encoder.layer.0.attention.qkv_proj.bias", GteModel, cache_dir)


def test_an_ntk_scaled_gte_matches_its_original_frequencies(gte_folder: Path, tmp_path: Path,
                                                           cache_dir: Path) -> None:
    """gte-*-en-v1.5's ``rope_scaling`` {type: ntk, factor: 2}: the original code rotates by the base
    ``theta * 2`` and divides every frequency by ``2 ** (2 / head_dim)``, at every length.
    transformers' GTE has no such scaling: its model, with those frequencies set, is the reference
    (the formula as the original code computes it, in float32)."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer, GteModel

    from dietserve.compile.artifact import CompileRequest, compile_artifact
    from dietserve.runtime.artifact import load_artifact
    from dietserve.runtime.embedder import Embedder
    from dietserve.runtime.engine import Engine

    from .test_encoder_families import TEXTS

    original = _gte_as_original(gte_folder, tmp_path / "original", rope_scaling={"type": "ntk", "factor": 2.0})
    embedder = Embedder(Engine(load_artifact(compile_artifact(CompileRequest(model=str(original), max_batch=8),
                                                              cache_dir))))
    output = embedder.encode(TEXTS).last_hidden_state
    reference = GteModel.from_pretrained(str(gte_folder), attn_implementation="eager").eval()
    encoded = AutoTokenizer.from_pretrained(str(gte_folder))(TEXTS, padding=True, truncation=True,
                                                             max_length=MAX_LENGTH, return_tensors="pt")
    mask = encoded["attention_mask"].numpy()[..., None]
    with torch.no_grad():
        unscaled = reference(**encoded).last_hidden_state.numpy()
        dim = reference.config.hidden_size // reference.config.num_attention_heads
        theta = reference.config.rope_parameters["rope_theta"]
        scaled = 1.0 / ((theta * 2.0) ** (torch.arange(0, dim, 2).float() / dim)) / 2.0 ** (2 / dim)
        reference.rotary_emb.inv_freq.copy_(scaled)
        expected = reference(**encoded).last_hidden_state.numpy()
    assert np.abs((unscaled - expected) * mask).max() > 1e-2
    np.testing.assert_allclose(output * mask, expected * mask, rtol=0, atol=1e-4)


@pytest.mark.parametrize("key,value", [("rope_scaling", {"type": "dynamic", "factor": 2.0}),
                                       ("logn_attention_scale", True), ("layer_norm_type", "rms_norm"),
                                       ("pack_qkv", False)])
def test_original_gte_options_we_do_not_compile_are_refused_by_name(gte_folder: Path, tmp_path: Path, key: str,
                                                                    value) -> None:
    original = _gte_as_original(gte_folder, tmp_path / "original", **{key: value})
    with pytest.raises(CheckpointError, match=f"{key}=.* is not supported for GTE"):
        Checkpoint.open(original)
