"""Sparse encoders (SPLADE, as naver/splade-v3 and opensearch's neural sparse models), randomly
initialised, saved by sentence-transformers as a SparseEncoder (MLMTransformer, then
SpladePooling), compile through the same pipeline and give the vocabulary's weights
sentence-transformers gives: BERT's masked-language-model head, RoBERTa's and DistilBERT's under
their own names, a decoder tied to the word embeddings, both pooling strategies and activations,
in both layouts; and the server's TEI route ``/embed_sparse`` answers the nonzero weights."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import requests

from dietserve.compile.artifact import CompileRequest, compile_artifact
from dietserve.compile.target import TargetSpec
from dietserve.host.cpu import cpu_flags
from dietserve.model.checkpoint import Checkpoint, CheckpointError
from dietserve.model.presets import default_model_folder
from dietserve.model.tokenizer import TOKENIZER_FILES
from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.embedder import Embedder
from dietserve.runtime.engine import Engine
from dietserve.runtime.manifest import Manifest

from .server_process import ServerProcess
from .test_encoder_families import _config as xlmr_config
from .test_encoder_families import _tokenizer_folder as xlmr_tokenizer_folder

TEXTS = [
    "A man is eating food.",
    "SPLADE weighs the words of the vocabulary a text is about, for search by terms.",
    "Hi",
    "How many people live in Berlin? " * 6,
]
ATOL = 1e-5  # the weights are log1p of logits of O(1)
# The decoder's bias, below the logits' spread: most of the vocabulary weighs zero, as in a
# trained sparse encoder, and a wrong head or pooling shows in which entries do not.
BIAS = -2.0


def _with_bert_tokenizer(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (default_model_folder() / name).is_file():
            (folder / name).write_bytes((default_model_folder() / name).read_bytes())
    return folder


def _masked_lm(family: str, folder: Path) -> Path:
    """A randomly initialised ``*ForMaskedLM`` saved by transformers (its decoder tied to the
    word embeddings, so not saved), with a tokenizer."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, DistilBertConfig, DistilBertForMaskedLM

    torch.manual_seed(3)
    if family == "xlm-roberta":
        from transformers import XLMRobertaForMaskedLM

        xlmr_tokenizer_folder(folder)
        model = XLMRobertaForMaskedLM(xlmr_config(len(AutoTokenizer.from_pretrained(str(folder)))))
        bias = model.lm_head.bias
    elif family == "distilbert":
        model = DistilBertForMaskedLM(DistilBertConfig(vocab_size=30522, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                                                       max_position_embeddings=128, initializer_range=0.1))
        bias = model.vocab_projector.bias
        _with_bert_tokenizer(folder)
    else:
        model = BertForMaskedLM(BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=128, max_position_embeddings=128, initializer_range=0.1))
        bias = model.cls.predictions.bias
        _with_bert_tokenizer(folder)
    with torch.no_grad():
        bias.fill_(BIAS)
    model.eval().save_pretrained(str(folder))
    return folder


def sparse_encoder(root: Path, family: str = "bert", strategy: str = "max", activation: str = "relu") -> Path:
    """Saved as sentence-transformers 6 saves it: a fill-mask Transformer, then SpladePooling."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.models import Transformer
    from sentence_transformers.sparse_encoder.models import SpladePooling

    transformer = Transformer(str(_masked_lm(family, root / "mlm")), transformer_task="fill-mask")
    folder = root / "sparse"
    SparseEncoder(modules=[transformer, SpladePooling(strategy, activation)], device="cpu").save(str(folder))
    return folder


# sentence-transformers 5's name of the fill-mask transformer, which the Hub's checkpoints hold
MLM_TRANSFORMER = "sentence_transformers.sparse_encoder.models.MLMTransformer"


def _as_saved_by_version_5(folder: Path) -> Path:
    _rewritten_modules(folder, lambda modules: [{**modules[0], "type": MLM_TRANSFORMER}, modules[1]])
    (folder / "sentence_bert_config.json").unlink()
    return folder


def _expected(folder: Path) -> np.ndarray:
    from sentence_transformers import SparseEncoder

    return SparseEncoder(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True).to_dense().numpy()


CASES = {  # family, strategy, activation, layout (cold start: planned from the hardware model, as served)
    "bert-packed": ("bert", "max", "relu", None),
    "bert-cold-start": ("bert", "max", "relu", "cold start"),
    "bert-padded": ("bert", "max", "relu", "padded"),
    "sum-of-log1p-relu-packed": ("bert", "sum", "log1p_relu", None),
    "sum-of-log1p-relu-padded": ("bert", "sum", "log1p_relu", "padded"),
    "distilbert": ("distilbert", "max", "relu", None),
    "xlm-roberta": ("xlm-roberta", "max", "log1p_relu", None),
    "saved-by-version-5": ("bert", "max", "relu", None),
}


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def compiled(request, tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> tuple[Path, Engine]:
    family, strategy, activation, layout = CASES[request.param]
    folder = sparse_encoder(tmp_path_factory.mktemp("splade"), family, strategy, activation)
    if request.param == "saved-by-version-5":
        _as_saved_by_version_5(folder)
    cold = layout == "cold start"
    request = CompileRequest(model=str(folder), max_batch=8, layout=None if cold else layout, analytic=cold)
    return folder, Engine(load_artifact(compile_artifact(request, cache_dir)))


def test_weights_match_sentence_transformers(compiled) -> None:
    folder, engine = compiled
    expected = _expected(folder)
    ours = Embedder(engine).embed(TEXTS)
    assert engine.sparse and ours.shape == expected.shape == (len(TEXTS), engine.vocab_size)
    # sparse as a trained model's, so which entries are nonzero says something
    assert 0 < (expected > 0).mean() < 0.5
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    if engine.packed:  # (the packed kernel takes log1p; the padded graph log(1 + x), zero below 6e-8)
        np.testing.assert_array_equal(ours > 0, expected > 0)


@pytest.mark.skipif("avx512_bf16" not in (cpu_flags() or set()), reason="this CPU has no AVX512-BF16")
def test_a_bf16_build_keeps_the_accuracy_contract(tmp_path: Path, cache_dir: Path) -> None:
    """bf16 products (the decoder's too), fp32 sums and pooling: each text's weights within the
    bf16 contract's per-token cosine (0.9999) of sentence-transformers' fp32: each weight is one
    token's logit (the largest), not an average over the tokens as a sentence embedding is."""
    folder = sparse_encoder(tmp_path)
    request = CompileRequest(model=str(folder), max_batch=8, analytic=True, precision="bf16")
    ours = Embedder(Engine(load_artifact(compile_artifact(request, cache_dir)))).embed(TEXTS)
    expected = _expected(folder)
    cosine = (ours * expected).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() >= 0.9999, cosine
    assert not np.allclose(ours, expected, rtol=0, atol=ATOL)  # (bf16 indeed: not fp32's numbers)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_a_cuda_build_carries_its_kernels(tmp_path: Path, cache_dir: Path) -> None:
    """The padded graph (the head on every slot, pooled by masked reductions) builds for CUDA;
    running it needs a GPU (``tests/gpu``)."""
    request = CompileRequest(model=str(sparse_encoder(tmp_path)), target=TargetSpec(kind="cuda", arch="sm_90"),
                             max_batch=8)
    manifest = Manifest.read(compile_artifact(request, cache_dir))
    # only the sparse recipe: the dense one's modes and normalize do not apply to it
    assert manifest.pooling == {"splade": {"strategy": "max", "activation": "relu", "max_active_dims": None}}
    assert manifest.layout == "padded" and manifest.output_shapes["sentence_embedding"] == [-1, 30522]


def test_max_active_dims_keeps_the_largest_weights(tmp_path: Path, cache_dir: Path) -> None:
    """A SparseEncoder saved with ``max_active_dims`` keeps each text's that many largest
    weights, as sentence-transformers' encode does."""
    from sentence_transformers import SparseEncoder

    folder = sparse_encoder(tmp_path)
    reference = SparseEncoder(str(folder), device="cpu")
    reference.max_active_dims = 7
    reference.save(str(folder))
    assert json.loads((folder / "config_sentence_transformers.json").read_text())["max_active_dims"] == 7
    expected = _expected(folder)
    assert (np.count_nonzero(expected, axis=1) == 7).all()
    engine = Engine(load_artifact(compile_artifact(CompileRequest(model=str(folder), max_batch=8), cache_dir)))
    ours = Embedder(engine).embed(TEXTS)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    assert (np.count_nonzero(ours, axis=1) == 7).all()


def test_a_sparse_encoder_is_recorded_and_refuses_other_pooling(tmp_path: Path) -> None:
    folder = sparse_encoder(tmp_path, strategy="sum")
    checkpoint = Checkpoint.open(folder)
    assert checkpoint.pooling.to_dict()["splade"] == {"strategy": "sum", "activation": "relu", "max_active_dims": None}
    assert checkpoint.model().output_shapes()["sentence_embedding"] == [-1, 30522]
    with pytest.raises(CheckpointError, match="is a sparse encoder"):
        checkpoint.with_pooling_modes(("mean",))


def test_pooling_splade_makes_a_masked_language_model_a_sparse_encoder(tmp_path: Path, cache_dir: Path) -> None:
    """``--pooling splade`` (TEI's flag) on a *ForMaskedLM folder with no modules.json: the
    checkpoint under SpladePooling's defaults, as sentence-transformers builds it from the folder."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.models import Transformer
    from sentence_transformers.sparse_encoder.models import SpladePooling

    folder = _masked_lm("bert", tmp_path / "mlm")
    artifact = compile_artifact(CompileRequest(model=str(folder), max_batch=8, pooling=("splade",)), cache_dir)
    reference = SparseEncoder(modules=[Transformer(str(folder), transformer_task="fill-mask"), SpladePooling()],
                              device="cpu")
    expected = reference.encode(TEXTS, convert_to_tensor=True).to_dense().numpy()
    np.testing.assert_allclose(Embedder(Engine(load_artifact(artifact))).embed(TEXTS), expected, rtol=0, atol=ATOL)
    with pytest.raises(ValueError, match="splade pools a masked-language model's logits, with no other mode"):
        CompileRequest(model=str(folder), pooling=("splade", "mean"))
    without_head = tmp_path / "encoder"
    from transformers import BertModel

    BertModel.from_pretrained(str(folder)).save_pretrained(str(without_head))
    _with_bert_tokenizer(without_head)
    with pytest.raises(CheckpointError, match="have no masked-language-model head"):
        compile_artifact(CompileRequest(model=str(without_head), max_batch=8, pooling=("splade",)), cache_dir)


def test_embed_prints_the_heaviest_terms(tmp_path: Path, cache_dir: Path) -> None:
    """``python -m dietserve embed`` on a sparse encoder: how many weights are nonzero and the
    heaviest terms, decoded, as the reference weighs them."""
    from transformers import AutoTokenizer

    folder = sparse_encoder(tmp_path)
    artifact = compile_artifact(CompileRequest(model=str(folder), max_batch=8), cache_dir)
    text = TEXTS[1]
    completed = subprocess.run([sys.executable, "-m", "dietserve", "embed", "--artifact", str(artifact), text],
                               capture_output=True, text=True, timeout=300, check=True)
    expected = _expected(folder)[1]
    heaviest = np.argsort(-expected, kind="stable")[:3]
    terms = ", ".join(f"{AutoTokenizer.from_pretrained(str(folder)).decode([int(i)])!r} {expected[i]:.3f}"
                      for i in heaviest)
    assert f"{text!r}: {np.count_nonzero(expected)} of 30522 vocabulary weights nonzero; most: {terms}" \
        in completed.stdout


def _rewritten_modules(folder: Path, edit) -> None:
    path = folder / "modules.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def test_what_is_not_compiled_is_refused_by_name(tmp_path: Path) -> None:
    folder = sparse_encoder(tmp_path)
    pooling_config = folder / "1_SpladePooling" / "config.json"
    settings = json.loads(pooling_config.read_text())
    pooling_config.write_text(json.dumps({**settings, "pooling_strategy": "mean"}))
    with pytest.raises(CheckpointError, match="pooling_strategy 'mean' is not supported"):
        Checkpoint.open(folder)
    pooling_config.write_text(json.dumps(settings))
    # an inference-free query side (opensearch's): a static embedding, not a transformer
    saved = (folder / "modules.json").read_text()
    _rewritten_modules(folder, lambda modules: [
        {**modules[0], "type": "sentence_transformers.sparse_encoder.models.SparseStaticEmbedding"}, modules[1]])
    with pytest.raises(CheckpointError, match="'sentence_transformers.sparse_encoder.models.SparseStaticEmbedding' "
                                              "is not supported"):
        Checkpoint.open(folder)
    (folder / "modules.json").write_text(saved)
    _rewritten_modules(folder, lambda modules: [modules[1], modules[0]])
    with pytest.raises(CheckpointError, match="lists SpladePooling, Transformer: dietserve compiles a sparse encoder "
                                              "of a fill-mask Transformer"):
        Checkpoint.open(folder)
    _rewritten_modules(folder, lambda modules: [modules[1], modules[0]])
    settings_file = folder / "sentence_bert_config.json"
    transformer_settings = json.loads(settings_file.read_text())
    settings_file.write_text(json.dumps({**transformer_settings, "transformer_task": "feature-extraction"}))
    with pytest.raises(CheckpointError, match="transformer_task is 'feature-extraction', not 'fill-mask'"):
        Checkpoint.open(folder)
    settings_file.write_text(json.dumps(transformer_settings))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "modernbert"}))
    with pytest.raises(CheckpointError, match="a modernbert sparse encoder is not supported"):
        Checkpoint.open(folder)


# ---------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path, minilm_artifact: Path):
    """A sparse encoder and a dense embedder (MiniLM) served side by side."""
    folder = sparse_encoder(tmp_path_factory.mktemp("served-splade"))
    artifact = compile_artifact(CompileRequest(model=str(folder), max_batch=8), cache_dir)
    process = ServerProcess(None, "--artifact", str(artifact), "--artifact", str(minilm_artifact), model_name=None)
    yield folder, (Manifest.read(artifact).model_name, Manifest.read(minilm_artifact).model_name), process
    process.stop()


def _post(process: ServerProcess, path: str, body: dict) -> requests.Response:
    return requests.post(f"http://{process.http_url}{path}", json=body, timeout=60)


@pytest.mark.slow
def test_embed_sparse_answers_the_nonzero_weights(server) -> None:
    folder, (name, dense_name), process = server
    expected = _expected(folder)
    answer = _post(process, "/embed_sparse", {"inputs": TEXTS, "model": name})
    assert answer.status_code == 200, answer.text
    rows = answer.json()
    assert len(rows) == len(TEXTS)
    for row, weights in zip(rows, expected, strict=True):
        indices = [entry["index"] for entry in row]
        assert indices == np.flatnonzero(weights).tolist()
        np.testing.assert_allclose([entry["value"] for entry in row], weights[indices], rtol=0, atol=ATOL)
    # TEI's root answers a sparse encoder's inputs as /embed_sparse, a dense one's as /embed
    assert _post(process, "/", {"inputs": TEXTS, "model": name}).json() == rows
    assert len(_post(process, "/", {"inputs": "Hi", "model": dense_name}).json()[0]) == 384
    # /embed gives the whole vocabulary's weights, unnormalised only, as TEI does
    refused = _post(process, "/embed", {"inputs": TEXTS[0], "model": name})
    assert refused.status_code == 400 and "is a sparse encoder (SPLADE)" in refused.json()["error"]
    dense = _post(process, "/embed", {"inputs": TEXTS[0], "model": name, "normalize": False})
    np.testing.assert_allclose(dense.json()[0], expected[0], rtol=0, atol=ATOL)
    openai = _post(process, "/v1/embeddings", {"input": TEXTS[0], "model": name})
    np.testing.assert_allclose(openai.json()["data"][0]["embedding"], expected[0], rtol=0, atol=ATOL)
    shortened = _post(process, "/v1/embeddings", {"input": TEXTS[0], "model": name, "dimensions": 8})
    assert shortened.status_code == 400 and "is a sparse encoder (SPLADE)" in shortened.json()["error"]["message"]
    info = requests.get(f"http://{process.http_url}/info", params={"model": name}, timeout=60).json()
    assert info["model_type"] == {"embedding": {"pooling": "splade"}}
    wrong = _post(process, "/embed_sparse", {"inputs": "Hi", "model": dense_name})
    assert wrong.status_code == 400
    assert wrong.json()["error"].startswith(f"/embed_sparse needs a sparse encoder (SPLADE); '{dense_name}'")
    assert _post(process, "/embed", {"inputs": "Hi", "model": dense_name}).status_code == 200


@pytest.mark.slow
def test_teis_grpc_embed_sparse_answers_as_the_http_route(server) -> None:
    import grpc

    from dietserve.server._proto import tei_pb2 as tei
    from dietserve.server._proto import tei_pb2_grpc as tei_grpc

    folder, (name, _), process = server
    expected = _expected(folder)
    with grpc.insecure_channel(process.grpc_url) as channel:
        stub = tei_grpc.EmbedStub(channel)
        named = (("model", name),)
        answers = list(stub.EmbedSparseStream((tei.EmbedSparseRequest(inputs=text) for text in TEXTS), metadata=named))
        for answer, weights in zip(answers, expected, strict=True):
            indices = [entry.index for entry in answer.sparse_embeddings]
            assert indices == np.flatnonzero(weights).tolist()
            np.testing.assert_allclose([entry.value for entry in answer.sparse_embeddings], weights[indices],
                                       rtol=0, atol=ATOL)
        with pytest.raises(grpc.RpcError) as refused:  # as /embed refuses it: TEI's normalize defaults to true
            stub.Embed(tei.EmbedRequest(inputs=TEXTS[0]), metadata=named)
        assert "is a sparse encoder (SPLADE)" in refused.value.details()
        unnormalised = stub.Embed(tei.EmbedRequest(inputs=TEXTS[0], normalize=False), metadata=named)
        np.testing.assert_allclose(unnormalised.embeddings, expected[0], rtol=0, atol=ATOL)
