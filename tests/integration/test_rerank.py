"""A classifier (cross-encoder) artifact served end to end: TEI's /rerank and /predict, Cohere's
/v1/rerank, and logits over v2 (gRPC and HTTP), each checked against sentence-transformers'
CrossEncoder and transformers run on the same checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as triton_grpc

from dietserve.compile.artifact import CompileRequest, compile_artifact

from .server_process import REPO_ROOT, ServerProcess
from .test_classification import PAIRS, classification_folder

pytestmark = pytest.mark.slow
ATOL = 1e-4
QUERY = "How many people live in Berlin?"
DOCUMENTS = [document for _, document in PAIRS] + [
    "Berlin is the capital of Germany.", "The city of Berlin counts close to four million people.",
    "Paris is in France.", "Apples are red or green.", "Inhabitants of Berlin: about 3.7 million.",
    "A very short one."]  # 11 documents: more than one batch of 8
LONG_DOCUMENT = "Berlin " * 200  # over the test model's 128 tokens


def _serve(tmp_path_factory, cache_dir: Path, labels: int, name: str):
    folder = classification_folder(tmp_path_factory.mktemp(name) / "model", labels)
    artifact = compile_artifact(CompileRequest(model=str(folder), max_batch=8), cache_dir)
    return folder, ServerProcess(artifact, model_name=name)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, cache_dir: Path):
    """A one-label cross-encoder (a relevance score), compiled once for this module."""
    folder, server = _serve(tmp_path_factory, cache_dir, 1, "reranker")
    yield folder, server
    server.stop()


@pytest.fixture(scope="module")
def nli(tmp_path_factory, cache_dir: Path):
    """A three-label classifier."""
    folder, server = _serve(tmp_path_factory, cache_dir, 3, "nli")
    yield folder, server
    server.stop()


def transformers_logits(folder: Path, items: list, truncate_to: int | None = None,
                        truncation_side: str = "right") -> np.ndarray:
    """The checkpoint's logits by transformers: items are texts or (text, text_pair) pairs."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(str(folder), truncation_side=truncation_side)
    pairs = isinstance(items[0], tuple)
    encoded = tokenizer([a for a, _ in items] if pairs else items, [b for _, b in items] if pairs else None,
                        padding=True, truncation="longest_first" if truncate_to else False, max_length=truncate_to,
                        return_tensors="pt")
    model = BertForSequenceClassification.from_pretrained(str(folder), attn_implementation="eager").eval()
    with torch.no_grad():
        return model(**encoded).logits.numpy()


def cross_encoder_scores(folder: Path, pairs: list, max_length: int | None = None) -> np.ndarray:
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(folder), device="cpu", local_files_only=True, max_length=max_length)
    return model.predict(pairs, convert_to_numpy=True)


def _post(server: ServerProcess, path: str, body: dict) -> requests.Response:
    return requests.post(f"http://{server.http_url}{path}", json=body, timeout=60)


# ---------------------------------------------------------------------------- TEI and Cohere


def test_rerank_scores_match_cross_encoder_and_transformers(reranker):
    folder, server = reranker
    answer = _post(server, "/rerank", {"query": QUERY, "texts": DOCUMENTS, "return_text": True})
    assert answer.status_code == 200, answer.text
    ranked = answer.json()
    assert [entry["score"] for entry in ranked] == sorted((entry["score"] for entry in ranked), reverse=True)
    assert all(entry["text"] == DOCUMENTS[entry["index"]] for entry in ranked)
    scores = np.zeros(len(DOCUMENTS))
    for entry in ranked:
        scores[entry["index"]] = entry["score"]
    pairs = [(QUERY, document) for document in DOCUMENTS]
    np.testing.assert_allclose(scores, cross_encoder_scores(folder, pairs), rtol=0, atol=ATOL)
    logits = transformers_logits(folder, pairs)[:, 0]
    np.testing.assert_allclose(scores, 1 / (1 + np.exp(-logits)), rtol=0, atol=ATOL)
    raw = _post(server, "/rerank", {"query": QUERY, "texts": DOCUMENTS, "raw_scores": True}).json()
    assert "text" not in raw[0]
    np.testing.assert_allclose([entry["score"] for entry in sorted(raw, key=lambda e: e["index"])], logits,
                               rtol=0, atol=ATOL)


def test_cohere_rerank_orders_cuts_to_top_n_and_returns_documents(reranker):
    folder, server = reranker
    expected = cross_encoder_scores(folder, [(QUERY, document) for document in DOCUMENTS])
    body = {"model": "reranker", "query": QUERY, "top_n": 3, "return_documents": True,
            "documents": [{"text": d} if i % 2 else d for i, d in enumerate(DOCUMENTS)]}
    answer = _post(server, "/v1/rerank", body)
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    assert [r["index"] for r in results] == list(np.argsort(-expected)[:3])
    np.testing.assert_allclose([r["relevance_score"] for r in results], np.sort(expected)[::-1][:3], atol=ATOL)
    assert [r["document"]["text"] for r in results] == [DOCUMENTS[r["index"]] for r in results]
    assert answer.json()["id"] and answer.json()["meta"]["tokens"]["input_tokens"] > 0
    everything = _post(server, "/v1/rerank", {"model": "reranker-text", "query": QUERY, "documents": DOCUMENTS})
    assert len(everything.json()["results"]) == len(DOCUMENTS) and "document" not in everything.json()["results"][0]
    unknown = _post(server, "/v1/rerank", {"model": "rerank-9", "query": QUERY, "documents": DOCUMENTS})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    bad = _post(server, "/v1/rerank", {"model": "reranker", "query": QUERY, "documents": DOCUMENTS, "top_n": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_n"


def test_predict_gives_softmax_over_labels_as_transformers(nli):
    folder, server = nli
    pairs = PAIRS[:4]
    answer = _post(server, "/predict", {"inputs": [list(pair) for pair in pairs]})
    assert answer.status_code == 200, answer.text
    logits = transformers_logits(folder, pairs)
    expected = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    for row, predictions in zip(expected, answer.json(), strict=True):
        assert [p["score"] for p in predictions] == sorted((p["score"] for p in predictions), reverse=True)
        got = {p["label"]: p["score"] for p in predictions}
        np.testing.assert_allclose([got[label] for label in ("contradiction", "entailment", "neutral")], row,
                                   atol=ATOL)
    single = _post(server, "/predict", {"inputs": list(pairs[0]), "raw_scores": True}).json()
    assert isinstance(single[0], dict)  # one input: one list of predictions
    np.testing.assert_allclose(sorted(p["score"] for p in single), np.sort(logits[0]), atol=ATOL)
    text = _post(server, "/predict", {"inputs": "A man is eating food.", "raw_scores": True}).json()
    np.testing.assert_allclose(sorted(p["score"] for p in text),
                               np.sort(transformers_logits(folder, ["A man is eating food."])[0]), atol=ATOL)


def test_a_multi_label_model_does_not_rerank_and_predict_names_bad_inputs(nli):
    _, server = nli
    answer = _post(server, "/rerank", {"query": QUERY, "texts": DOCUMENTS})
    assert answer.status_code == 400 and "one label" in answer.json()["error"] and "/predict" in answer.json()["error"]
    bad = _post(server, "/predict", {"inputs": [["a", "b", "c"], "d"]})
    assert bad.status_code == 400 and "inputs[0] must be a text, [text] or [text, text_pair]" in bad.json()["error"]


def test_pair_truncation_is_refused_unless_asked_and_then_cut_as_cross_encoder_does(reranker):
    folder, server = reranker
    texts = ["Berlin is big.", LONG_DOCUMENT]
    refused = _post(server, "/rerank", {"query": QUERY, "texts": texts})
    assert refused.status_code == 413
    assert "pair 1 has 210 tokens, over the model's maximum of 128" in refused.json()["error"]
    answer = _post(server, "/rerank", {"query": QUERY, "texts": texts, "truncate": True, "raw_scores": True})
    got = [entry["score"] for entry in sorted(answer.json(), key=lambda entry: entry["index"])]
    pairs = [(QUERY, text) for text in texts]
    np.testing.assert_allclose(got, transformers_logits(folder, pairs, truncate_to=128)[:, 0], atol=ATOL)
    scores = _post(server, "/rerank", {"query": QUERY, "texts": texts, "truncate": True}).json()
    np.testing.assert_allclose(sorted(entry["score"] for entry in scores),
                               np.sort(cross_encoder_scores(folder, pairs, max_length=128)), atol=ATOL)


def test_a_classifier_gives_no_embeddings(reranker):
    _, server = reranker
    answer = _post(server, "/v1/embeddings", {"model": "reranker", "input": "hi"})
    assert answer.status_code == 400 and "is a classifier (cross-encoder)" in answer.json()["error"]["message"]


def test_the_embed_command_refuses_a_classifier(reranker, cache_dir: Path):
    folder, _ = reranker
    artifact = compile_artifact(CompileRequest(model=str(folder), max_batch=8), cache_dir)  # cached
    completed = subprocess.run([sys.executable, "-m", "dietserve", "embed", "--artifact", str(artifact), "hi"],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 2 and "is a classifier (cross-encoder)" in completed.stderr


# ---------------------------------------------------------------------------- KServe v2


def _text_pairs(pairs: list) -> triton_grpc.InferInput:
    tensor = triton_grpc.InferInput("text", [len(pairs), 2], "BYTES")
    tensor.set_data_from_numpy(np.array([[a.encode(), b.encode()] for a, b in pairs], dtype=object))
    return tensor


def test_grpc_answers_logits_for_text_pairs_and_token_ids(reranker):
    from transformers import AutoTokenizer

    folder, server = reranker
    pairs = list(PAIRS)
    expected = transformers_logits(folder, pairs)
    encoded = AutoTokenizer.from_pretrained(str(folder))([a for a, _ in pairs], [b for _, b in pairs], padding=True,
                                                         return_tensors="np")
    with triton_grpc.InferenceServerClient(server.grpc_url) as client:
        metadata = client.get_model_metadata("reranker-text")
        assert [(t.name, list(t.shape)) for t in metadata.inputs] == [("text", [-1, 2])]
        assert {t.name: list(t.shape) for t in metadata.outputs} == {"last_hidden_state": [-1, -1, 64],
                                                                     "logits": [-1, 1]}
        text = client.infer("reranker-text", [_text_pairs(pairs)],
                            outputs=[triton_grpc.InferRequestedOutput("logits")])
        np.testing.assert_allclose(text.as_numpy("logits"), expected, rtol=0, atol=ATOL)
        inputs = []
        for name in ("input_ids", "attention_mask", "token_type_ids"):
            inputs.append(triton_grpc.InferInput(name, list(encoded[name].shape), "INT64"))
            inputs[-1].set_data_from_numpy(encoded[name].astype(np.int64))
        ids = client.infer("reranker", inputs)
        assert ids.as_numpy("logits").dtype == np.float32 and ids.as_numpy("logits").shape == (len(pairs), 1)
        np.testing.assert_allclose(ids.as_numpy("logits"), expected, rtol=0, atol=ATOL)


def test_grpc_refuses_a_second_text_input_and_long_pairs_clearly(reranker):
    _, server = reranker
    with triton_grpc.InferenceServerClient(server.grpc_url) as client:
        pair = triton_grpc.InferInput("text_pair", [1], "BYTES")
        pair.set_data_from_numpy(np.array([b"a document"], dtype=object))
        single = triton_grpc.InferInput("text", [1], "BYTES")
        single.set_data_from_numpy(np.array([QUERY.encode()], dtype=object))
        with pytest.raises(triton_grpc.InferenceServerException, match=r"unknown input 'text_pair'.*\[batch, 2\]"):
            client.infer("reranker-text", [single, pair])
        with pytest.raises(triton_grpc.InferenceServerException) as raised:
            client.infer("reranker-text", [_text_pairs([(QUERY, LONG_DOCUMENT)])])
        assert raised.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
        assert "pair 0 has 210 tokens" in raised.value.message()
        with pytest.raises(triton_grpc.InferenceServerException, match="unknown output 'sentence_embedding'"):
            client.infer("reranker-text", [_text_pairs(PAIRS[:1])],
                         outputs=[triton_grpc.InferRequestedOutput("sentence_embedding")])
        assert client.is_server_ready()


def test_v2_rest_answers_logits(reranker):
    folder, server = reranker
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2, 2], "data": [list(p) for p in PAIRS[:2]]}],
            "outputs": [{"name": "logits"}]}
    answer = _post(server, "/v2/models/reranker-text/infer", body)
    assert answer.status_code == 200, answer.text
    (output,) = answer.json()["outputs"]
    assert output["name"] == "logits" and output["shape"] == [2, 1] and output["datatype"] == "FP32"
    np.testing.assert_allclose(output["data"], transformers_logits(folder, PAIRS[:2])[:, 0], atol=ATOL)
    config = requests.get(f"http://{server.http_url}/v2/models/reranker-text/config", timeout=30).json()
    assert config["input"][0]["dims"] == [2] and config["output"][1] == {"name": "logits", "data_type": "TYPE_FP32",
                                                                         "dims": [1]}
