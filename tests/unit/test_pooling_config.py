"""What a checkpoint puts on top of the encoder, read without a build: sentence-transformers'
modules.json (Pooling modes, Dense, Normalize), --pooling, and a sequence-classification
config; what is not supported is refused by name."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dietserve.commands.common import add_build_flags, build_argv, compile_request
from dietserve.compile.artifact import CompileRequest, cache_key
from dietserve.compile.target import TargetSpec, build_target
from dietserve.model.bert import export_relax
from dietserve.model.checkpoint import Checkpoint, CheckpointError, load_parameters
from dietserve.model.config import BertConfig
from dietserve.model.heads import POOLING_MODES, parse_pooling_modes
from dietserve.model.presets import random_hf_weights
from dietserve.model.tokenizer import read_pair_template

TINY = BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=16, max_position_embeddings=12)
TRANSFORMER = {"path": "", "type": "sentence_transformers.models.Transformer"}


def _checkpoint(folder: Path, architectures: tuple[str, ...] = ("BertModel",), **config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    raw = {"model_type": "bert", "architectures": list(architectures), **TINY.to_dict(), **config}
    (folder / "config.json").write_text(json.dumps(raw))
    save_file(random_hf_weights(TINY, seed=1), str(folder / "model.safetensors"))
    return folder


def _module(folder: Path, kind: str, path: str, config: dict | None = None) -> dict:
    if config is not None:
        (folder / path).mkdir(parents=True, exist_ok=True)
        (folder / path / "config.json").write_text(json.dumps(config))
    return {"path": path, "type": f"sentence_transformers.models.{kind}"}


def _dense(folder: Path, path: str, in_features: int, out_features: int, bias: bool = True,
           activation: str = "torch.nn.modules.activation.Tanh", weights: bool = True) -> dict:
    config = {"in_features": in_features, "out_features": out_features, "bias": bias,
              "activation_function": activation}
    module = _module(folder, "Dense", path, config)
    if weights:
        rng = np.random.default_rng(0)
        tensors = {"linear.weight": rng.standard_normal((out_features, in_features)).astype(np.float32)}
        if bias:
            tensors["linear.bias"] = rng.standard_normal(out_features).astype(np.float32)
        save_file(tensors, str(folder / path / "model.safetensors"))
    return module


def _modules(folder: Path, *modules: dict) -> Path:
    (folder / "modules.json").write_text(json.dumps(list(modules)))
    return folder


def _pooling(folder: Path, **config) -> dict:
    return _module(folder, "Pooling", "1_Pooling", config)


def test_legacy_flags_concatenate_in_sentence_transformers_order(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "ck")
    flags = {"pooling_mode_lasttoken": True, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}
    _modules(folder, TRANSFORMER, _pooling(folder, word_embedding_dimension=8, **flags))
    pooling = Checkpoint.open(folder).pooling
    assert pooling.modes == ("cls", "mean", "lasttoken") and not pooling.normalize
    assert pooling.embedding_size(8) == 24


def test_pooling_mode_key_keeps_its_order(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "ck")
    _modules(folder, TRANSFORMER, _pooling(folder, pooling_mode=["weightedmean", "max"]))
    assert Checkpoint.open(folder).pooling.modes == ("weightedmean", "max")


def test_dense_and_normalize_are_read_in_order(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "ck")
    _modules(folder, TRANSFORMER, _pooling(folder, pooling_mode="cls"),
             _dense(folder, "2_Dense", 8, 6), _dense(folder, "3_Dense", 6, 4, bias=False,
                                                      activation="torch.nn.modules.linear.Identity"),
             _module(folder, "Normalize", "4_Normalize"))
    checkpoint = Checkpoint.open(folder)
    assert [(d.in_features, d.out_features, d.bias, d.activation) for d in checkpoint.pooling.dense] == [
        (8, 6, True, "tanh"), (6, 4, False, "identity")]
    assert checkpoint.pooling.normalize and checkpoint.pooling.embedding_size(8) == 4
    assert len(checkpoint.weight_files) == 3
    model = checkpoint.model()
    _, expected = export_relax(model, max_batch=2)
    params = load_parameters(checkpoint, model, expected)
    first = load_file(str(folder / "2_Dense" / "model.safetensors"))
    np.testing.assert_array_equal(params["sentence.dense.0.weight"], first["linear.weight"].T)
    np.testing.assert_array_equal(params["sentence.dense.0.bias"], first["linear.bias"])
    assert "sentence.dense.1.bias" not in params
    assert model.output_shapes() == {"last_hidden_state": [-1, -1, 8], "sentence_embedding": [-1, 4]}


def test_no_modules_json_means_mean_pooling(tmp_path: Path) -> None:
    pooling = Checkpoint.open(_checkpoint(tmp_path / "ck")).pooling
    assert pooling.modes == ("mean",) and not pooling.dense and not pooling.normalize


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda f: [TRANSFORMER, _pooling(f), {"path": "2_Ln", "type": "sentence_transformers.models.LayerNorm"}],
         "module type 'sentence_transformers.models.LayerNorm' is not supported"),
        (lambda f: [TRANSFORMER, _pooling(f), {"path": "2", "type": "my_package.Custom"}],
         "module type 'my_package.Custom' is not supported"),
        (lambda f: [TRANSFORMER, _pooling(f, include_prompt=False)], "include_prompt=false"),
        (lambda f: [TRANSFORMER, _pooling(f, pooling_mode="median")], "unknown pooling mode 'median'"),
        (lambda f: [TRANSFORMER, _pooling(f), _dense(f, "2_Dense", 8, 4, weights=False)],
         "2_Dense has no model.safetensors or pytorch_model.bin"),
        (lambda f: [TRANSFORMER, _pooling(f), _dense(f, "2_Dense", 8, 4, activation="torch.nn.Softsign")],
         "activation_function 'torch.nn.Softsign' is not supported"),
        (lambda f: [TRANSFORMER, _pooling(f), _dense(f, "2_Dense", 16, 4)], "takes 16 features, its input has 8"),
        (lambda f: [TRANSFORMER, _pooling(f), _module(f, "Normalize", "2_N"), _dense(f, "3_Dense", 8, 4)],
         "comes after Normalize"),
        (lambda f: [TRANSFORMER, _module(f, "Normalize", "1_N")], "before Pooling"),
        (lambda f: [_module(f, "Transformer", "0_Transformer", {})], "Transformer module first, in the root"),
        (lambda f: [TRANSFORMER], "lists no Pooling module"),
    ],
    ids=["unknown sentence-transformers module", "foreign module", "include_prompt false", "unknown mode",
         "dense without safetensors", "unsupported activation", "dense of the wrong width",
         "dense after normalize", "normalize before pooling", "transformer in a subfolder", "no pooling"],
)
def test_unsupported_modules_are_refused_by_name(tmp_path: Path, build, message: str) -> None:
    folder = _checkpoint(tmp_path / "ck")
    _modules(folder, *build(folder))
    with pytest.raises(CheckpointError, match=message):
        Checkpoint.open(folder)


def test_dense_of_pytorch_pickles_only_is_read(tmp_path: Path) -> None:
    """Releases of sentence-transformers before safetensors saved Dense modules as pytorch_model.bin."""
    import torch

    folder = _checkpoint(tmp_path / "ck")
    dense = _dense(folder, "2_Dense", 8, 4, weights=False)
    weight, bias = torch.randn(4, 8), torch.randn(4)
    torch.save({"linear.weight": weight, "linear.bias": bias}, folder / "2_Dense" / "pytorch_model.bin")
    checkpoint = Checkpoint.open(_modules(folder, TRANSFORMER, _pooling(folder), dense))
    assert checkpoint.weight_files[-1] == folder / "2_Dense" / "pytorch_model.bin"
    model = checkpoint.model()
    params = load_parameters(checkpoint, model, export_relax(model, max_batch=2)[1])
    np.testing.assert_array_equal(params["sentence.dense.0.weight"], weight.numpy().T)
    np.testing.assert_array_equal(params["sentence.dense.0.bias"], bias.numpy())
    (folder / "2_Dense" / "pytorch_model.bin").write_bytes(b"")  # damaged: named, not a traceback
    with pytest.raises(CheckpointError, match="2_Dense/pytorch_model.bin is not a zip archive"):
        load_parameters(checkpoint, model, export_relax(model, max_batch=2)[1])


def test_pooling_flag_overrides_the_checkpoint_and_the_cache_key(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_build_flags(parser)
    folder = _checkpoint(tmp_path / "ck")
    request = compile_request(parser.parse_args(["--model", str(folder), "--pooling", "max,cls"]))
    assert request.pooling == ("max", "cls")
    with pytest.raises(SystemExit):
        parser.parse_args(["--pooling", "median"])
    checkpoint = Checkpoint.open(folder)
    overridden = checkpoint.with_pooling_modes(request.pooling)
    assert overridden.pooling.modes == ("max", "cls")
    target = build_target(TargetSpec())
    keys = {cache_key(ck, ["w"], target, 4) for ck in (checkpoint, overridden, checkpoint.with_pooling_modes(("cls",)))}
    assert len(keys) == 3


def test_pooling_flag_refuses_what_would_not_fit_a_dense_module(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "ck")
    _modules(folder, TRANSFORMER, _pooling(folder), _dense(folder, "2_Dense", 8, 4))
    with pytest.raises(CheckpointError, match="--pooling cls,max.*takes 8 features, its input has 16"):
        Checkpoint.open(folder).with_pooling_modes(("cls", "max"))


def test_pooling_modes_parse_and_refuse_by_name() -> None:
    assert parse_pooling_modes(" cls , mean ") == ("cls", "mean")
    assert parse_pooling_modes(",".join(POOLING_MODES)) == POOLING_MODES
    with pytest.raises(ValueError, match="unknown pooling mode 'avg'"):
        parse_pooling_modes("mean,avg")


def test_sequence_classification_checkpoint_is_recognised(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "ck", ("BertForSequenceClassification",),
                         id2label={"0": "negative", "1": "neutral", "2": "positive"})
    rng = np.random.default_rng(0)
    weights = {f"bert.{name}": tensor for name, tensor in random_hf_weights(TINY, seed=1).items()}
    weights.update({"bert.pooler.dense.weight": rng.standard_normal((8, 8)).astype(np.float32),
                    "bert.pooler.dense.bias": rng.standard_normal(8).astype(np.float32),
                    "classifier.weight": rng.standard_normal((3, 8)).astype(np.float32),
                    "classifier.bias": rng.standard_normal(3).astype(np.float32)})
    save_file(weights, str(folder / "model.safetensors"))
    checkpoint = Checkpoint.open(folder)
    assert checkpoint.task == "classification"
    assert checkpoint.classifier.labels == ("negative", "neutral", "positive")
    model = checkpoint.model()
    assert model.output_shapes() == {"last_hidden_state": [-1, -1, 8], "logits": [-1, 3]}
    _, expected = export_relax(model, max_batch=2)
    params = load_parameters(checkpoint, model, expected)
    np.testing.assert_array_equal(params["classifier.weight"], weights["classifier.weight"].T)
    np.testing.assert_array_equal(params["pooler.dense.bias"], weights["bert.pooler.dense.bias"])
    with pytest.raises(CheckpointError, match="--pooling applies to sentence-embedding models only"):
        checkpoint.with_pooling_modes(("cls",))


def test_classifier_labels_default_and_are_checked(tmp_path: Path) -> None:
    plain = _checkpoint(tmp_path / "a", ("BertForSequenceClassification",), num_labels=1)
    assert Checkpoint.open(plain).classifier.labels == ("LABEL_0",)
    gap = _checkpoint(tmp_path / "b", ("BertForSequenceClassification",), id2label={"0": "a", "2": "c"})
    with pytest.raises(CheckpointError, match=r"id2label has ids \[0, 2\]"):
        Checkpoint.open(gap)


def test_the_cache_key_follows_the_tokenizer_and_prompt_files(tmp_path: Path) -> None:
    """An artifact carries the checkpoint's tokenizer and prompts: editing either is a new build."""
    folder = _checkpoint(tmp_path / "ck")
    target = build_target(TargetSpec())

    def key() -> str:
        return cache_key(Checkpoint.open(folder), ["w"], target, 4)

    keys = [key()]
    (folder / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}))
    keys.append(key())
    (folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"query": "query: "}}))
    keys.append(key())
    (folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"query": "q: "}}))
    keys.append(key())
    assert len(set(keys)) == 4 and key() == keys[-1]


def test_classifier_tokens_and_pair_template_flags_reach_the_request_its_record_and_a_child_command() -> None:
    parser = argparse.ArgumentParser()
    add_build_flags(parser)
    args = parser.parse_args(["--model", "Qwen/Qwen3-Reranker-0.6B", "--classifier-from-tokens", "no,yes",
                              "--pair-template", "qwen3-reranker"])
    request = compile_request(args)
    assert request.classifier_tokens == ("no", "yes")
    assert request.pair_template == read_pair_template("qwen3-reranker").to_dict()
    for again in (CompileRequest.from_build_record(request.build_record()), compile_request(
            parser.parse_args(build_argv(args)))):
        assert (again.classifier_tokens, again.pair_template) == (("no", "yes"), request.pair_template)
    with pytest.raises(SystemExit):
        parser.parse_args(["--pair-template", "no-such-template"])
    for wrong in ("yes", "no,yes,maybe", "no,"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--classifier-from-tokens", wrong])
    with pytest.raises(ValueError, match="without pooling"):
        CompileRequest(pooling=("mean",), classifier_tokens=("no", "yes"))
