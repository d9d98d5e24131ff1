"""The HTTP port, end to end: a real server process, real clients (OpenAI's, tritonclient.http,
KServe's REST client, requests), answers checked against the same server's gRPC answers for the
same input and against an independent reference (transformers + the checkpoint's pooling)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import openai
import pytest
import requests
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http

from dietserve.model.tokenizer import TextTokenizer
from dietserve.runtime.embedder import artifact_tokenizer

from .scrape import metrics
from .server_process import ServerProcess
from .test_sentence_embedding import _reference_embeddings

pytestmark = pytest.mark.slow
MODEL = "minilm"
TEXT_MODEL = "minilm-text"
SENTENCES = ["A man is eating food.", "The new movie is awesome and everyone should see it twice.", "Hi"]
SAME = 1e-6  # one server, one input: the two wires must give the same numbers


@pytest.fixture(scope="module")
def server(minilm_artifact: Path):
    process = ServerProcess(minilm_artifact, "--max-request-bytes", str(1 << 20), model_name=MODEL)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def grpc_client(server: ServerProcess):
    with triton_grpc.InferenceServerClient(server.grpc_url) as client:
        yield client


@pytest.fixture(scope="module")
def openai_client(server: ServerProcess):
    with openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(minilm_engine) -> TextTokenizer:
    return artifact_tokenizer(minilm_engine)


def grpc_text_embeddings(client, texts: list[str], **parameters) -> np.ndarray:
    tensor = triton_grpc.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    result = client.infer(TEXT_MODEL, [tensor], outputs=[triton_grpc.InferRequestedOutput("sentence_embedding")],
                          parameters=parameters or None)
    return result.as_numpy("sentence_embedding")


def grpc_ids_embeddings(client, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    inputs = []
    for name, array in (("input_ids", ids), ("attention_mask", mask)):
        inputs.append(triton_grpc.InferInput(name, list(array.shape), "INT64"))
        inputs[-1].set_data_from_numpy(array.astype(np.int64))
    return client.infer(MODEL, inputs).as_numpy("sentence_embedding")


def padded(sequences: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    ids = np.zeros((len(sequences), max(map(len, sequences))), np.int64)
    mask = np.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)], mask[row, : len(sequence)] = sequence, 1
    return ids, mask


# ---------------------------------------------------------------------------- OpenAI


def test_openai_client_embeds_strings_as_grpc_does_and_as_the_reference(openai_client, grpc_client, tokenizer,
                                                                        minilm_reference):
    expected = grpc_text_embeddings(grpc_client, SENTENCES)
    one = openai_client.embeddings.create(model=MODEL, input=SENTENCES[0], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, expected[0], atol=SAME)
    many = openai_client.embeddings.create(model=TEXT_MODEL, input=SENTENCES, encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2] and many.model == TEXT_MODEL and many.object == "list"
    np.testing.assert_allclose([d.embedding for d in many.data], expected, atol=SAME)
    tokens = tokenizer.encode(SENTENCES).attention_mask.sum()  # special tokens in, padding out
    assert many.usage.prompt_tokens == many.usage.total_tokens == tokens
    reference, _ = _reference_embeddings(minilm_reference, SENTENCES)
    np.testing.assert_allclose([d.embedding for d in many.data], reference, atol=1e-4)


@pytest.mark.parametrize("body", [{}, {"model": None}], ids=["no model", "model null"])
def test_openai_embeddings_without_a_model_take_the_only_one_served(server, grpc_client, body):
    answer = requests.post(f"http://{server.http_url}/v1/embeddings", json={**body, "input": SENTENCES}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == MODEL
    np.testing.assert_allclose([d["embedding"] for d in answer.json()["data"]],
                               grpc_text_embeddings(grpc_client, SENTENCES), atol=SAME)


def test_openai_base64_is_little_endian_float32(openai_client, grpc_client, server):
    expected = grpc_text_embeddings(grpc_client, SENTENCES)
    # OpenAI's client asks for base64 by default and decodes it itself.
    decoded = openai_client.embeddings.create(model=MODEL, input=SENTENCES)
    np.testing.assert_allclose([d.embedding for d in decoded.data], expected, atol=SAME)
    raw = requests.post(f"http://{server.http_url}/v1/embeddings", timeout=30,
                        json={"model": MODEL, "input": SENTENCES[1], "encoding_format": "base64", "user": "ignored"})
    vector = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), "<f4")
    np.testing.assert_array_equal(vector, expected[1])


def test_openai_token_ids_embed_as_the_ids_model_does(openai_client, grpc_client, tokenizer):
    sequences = [tokenizer.encode([s]).input_ids[0].tolist() for s in SENTENCES]
    one = openai_client.embeddings.create(model=MODEL, input=sequences[0], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, grpc_ids_embeddings(grpc_client, *padded(sequences[:1]))[0],
                               atol=SAME)
    many = openai_client.embeddings.create(model=MODEL, input=sequences, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in many.data], grpc_ids_embeddings(grpc_client, *padded(sequences)),
                               atol=SAME)
    assert many.usage.prompt_tokens == sum(map(len, sequences))


def test_openai_dimensions_shorten_and_renormalise(openai_client, grpc_client):
    full = grpc_text_embeddings(grpc_client, SENTENCES[:2]).astype(np.float64)
    short = openai_client.embeddings.create(model=MODEL, input=SENTENCES[:2], dimensions=64, encoding_format="float")
    expected = full[:, :64] / np.linalg.norm(full[:, :64], axis=1, keepdims=True)  # MiniLM normalises
    np.testing.assert_allclose([d.embedding for d in short.data], expected, atol=SAME)
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client.embeddings.create(model=MODEL, input="hi", dimensions=1000)
    assert raised.value.body["param"] == "dimensions" and "over this model's 384" in raised.value.body["message"]


def test_openai_more_inputs_than_a_batch_are_split_and_kept_in_order(openai_client, grpc_client, minilm_engine):
    count = minilm_engine.max_batch * 2 + 3
    texts = [f"sentence number {i} about {'cats' if i % 2 else 'compilers'}" for i in range(count)]
    answer = openai_client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [d.index for d in answer.data] == list(range(len(texts)))
    expected = np.concatenate([grpc_text_embeddings(grpc_client, texts[i : i + 8]) for i in range(0, len(texts), 8)])
    np.testing.assert_allclose([d.embedding for d in answer.data], expected, atol=SAME)


def test_openai_models_and_errors_in_openai_shape(openai_client, server):
    assert {m.id for m in openai_client.models.list()} == {MODEL, TEXT_MODEL}
    with pytest.raises(openai.NotFoundError) as raised:
        openai_client.embeddings.create(model="gpt-7", input="hi")
    assert raised.value.body["code"] == "model_not_found" and "unknown model 'gpt-7'" in raised.value.body["message"]
    bad = requests.post(f"http://{server.http_url}/v1/embeddings", json={"model": MODEL, "input": [1, "a"]}, timeout=30)
    assert bad.status_code == 400
    assert bad.json()["error"] == {"message": "input mixes types: give strings only, or token ids (integers) only",
                                   "type": "invalid_request_error", "param": "input", "code": None}


def test_health_for_kubernetes_probes(server):
    answer = requests.get(f"http://{server.http_url}/health", timeout=10)
    assert answer.status_code == 200 and answer.json() == {"status": "ready"}


# ---------------------------------------------------------------------------- KServe v2 REST


def _http_text_input(texts: list[str], binary: bool) -> triton_http.InferInput:
    tensor = triton_http.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object), binary_data=binary)
    return tensor


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_http_infers_as_grpc_does(binary, server, grpc_client, tokenizer):
    expected_text = grpc_text_embeddings(grpc_client, SENTENCES)
    encoded = tokenizer.encode(SENTENCES)
    ids, mask = encoded.input_ids, encoded.attention_mask
    with triton_http.InferenceServerClient(server.http_url) as client:
        outputs = [triton_http.InferRequestedOutput("sentence_embedding", binary_data=binary)]
        text = client.infer(TEXT_MODEL, [_http_text_input(SENTENCES, binary)], outputs=outputs, request_id="t-1")
        np.testing.assert_allclose(text.as_numpy("sentence_embedding"), expected_text, atol=SAME)
        assert text.get_response()["id"] == "t-1" and text.as_numpy("last_hidden_state") is None
        inputs = []
        for name, array in (("input_ids", ids), ("attention_mask", mask)):
            inputs.append(triton_http.InferInput(name, list(array.shape), "INT64"))
            inputs[-1].set_data_from_numpy(array, binary_data=binary)
        both = client.infer(MODEL, inputs, outputs=None if binary else [
            triton_http.InferRequestedOutput(name, binary_data=False) for name in ("last_hidden_state",
                                                                                   "sentence_embedding")])
        grpc_both = grpc_client.infer(MODEL, [_grpc_input(n, a) for n, a in (("input_ids", ids),
                                                                            ("attention_mask", mask))])
        for name in ("last_hidden_state", "sentence_embedding"):
            np.testing.assert_allclose(both.as_numpy(name), grpc_both.as_numpy(name), atol=SAME)


def _grpc_input(name: str, array: np.ndarray) -> triton_grpc.InferInput:
    tensor = triton_grpc.InferInput(name, list(array.shape), "INT64")
    tensor.set_data_from_numpy(array)
    return tensor


def test_tritonclient_http_metadata_config_statistics_and_index(server, minilm_engine):
    with triton_http.InferenceServerClient(server.http_url) as client:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready(MODEL) and client.is_model_ready(TEXT_MODEL, model_version="1")
        assert client.get_server_metadata()["name"] == "dietserve"
        metadata = client.get_model_metadata(TEXT_MODEL)
        assert metadata["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
        assert metadata["versions"] == ["1"]
        config = client.get_model_config(MODEL)
        assert config["max_batch_size"] == minilm_engine.max_batch
        assert [i["name"] for i in config["input"]] == ["input_ids", "attention_mask", "token_type_ids"]
        assert client.get_model_repository_index() == [
            {"name": MODEL, "version": "1", "state": "READY"}, {"name": TEXT_MODEL, "version": "1", "state": "READY"}]
        stats = client.get_inference_statistics(MODEL)["model_stats"][0]
        assert stats["name"] == MODEL and isinstance(stats["inference_count"], int)
        with pytest.raises(triton_http.InferenceServerException, match="unknown model 'gpt-7'"):
            client.get_model_metadata("gpt-7")


def test_kserve_rest_client(server, minilm_engine):
    ids = [[101, 7592, 2088, 102, 0], [101, 2023, 2003, 1037, 102]]
    script = Path(__file__).parent / "clients" / "kserve_rest.py"
    completed = subprocess.run([sys.executable, str(script), f"http://{server.http_url}", MODEL, json.dumps(ids)],
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    answer = json.loads(completed.stdout.strip().splitlines()[-1])
    assert answer["live"] and answer["ready"] and answer["model_ready"]
    expected = minilm_engine.run(np.array(ids))
    for label in ("json", "binary"):
        np.testing.assert_allclose(answer["results"][label]["sentence_embedding"], expected.sentence_embedding,
                                   atol=1e-4)


def test_requests_on_v2_routes(server, grpc_client):
    base = f"http://{server.http_url}"
    assert requests.get(f"{base}/v2/health/live", timeout=10).json() == {"live": True}
    assert requests.get(f"{base}/v2/health/ready", timeout=10).json() == {"ready": True}
    assert requests.get(f"{base}/v2/models/{MODEL}/versions/1/ready", timeout=10).status_code == 200
    assert requests.get(f"{base}/v2/models/{MODEL}/versions/1", timeout=10).json()["name"] == MODEL
    assert requests.get(f"{base}/v2/models/{MODEL}/versions/1/stats", timeout=10).status_code == 200
    index = requests.post(f"{base}/v2/repository/index", json={"ready": True}, timeout=10).json()
    assert [m["name"] for m in index] == [MODEL, TEXT_MODEL]
    # Nested data, [batch, 1] text, an explicit JSON output.
    body = {"id": "r", "inputs": [{"name": "text", "datatype": "BYTES", "shape": [2, 1],
                                   "data": [[SENTENCES[0]], [SENTENCES[2]]]}],
            "outputs": [{"name": "sentence_embedding"}]}
    answer = requests.post(f"{base}/v2/models/{TEXT_MODEL}/infer", json=body, timeout=30)
    assert answer.status_code == 200 and answer.headers["Content-Type"].startswith("application/json")
    (output,) = answer.json()["outputs"]
    assert output["shape"] == [2, 384] and answer.json()["id"] == "r"
    expected = grpc_text_embeddings(grpc_client, [SENTENCES[0], SENTENCES[2]])
    np.testing.assert_allclose(np.array(output["data"]).reshape(2, 384), expected, atol=SAME)


def test_http_requests_are_counted_by_route_and_status(server):
    def count(route: str, code: str) -> float:
        return metrics(server).get(("dietserve_http_requests_total", (("code", code), ("route", route))), 0.0)

    infer_route = "/v2/models/{model}/infer"
    before = (count("/v1/embeddings", "200"), count(infer_route, "400"), count("unknown", "404"))
    requests.post(f"http://{server.http_url}/v1/embeddings", json={"model": MODEL, "input": "hi"}, timeout=30)
    requests.post(f"http://{server.http_url}/v2/models/{MODEL}/infer", data=b"{", timeout=30)
    requests.get(f"http://{server.http_url}/v3/anything", timeout=30)
    after = (count("/v1/embeddings", "200"), count(infer_route, "400"), count("unknown", "404"))
    assert after == tuple(b + 1 for b in before)


@pytest.mark.parametrize("path, body", [
    ("/rerank", {"query": "q", "texts": ["a"]}),
    ("/v1/rerank", {"model": MODEL, "query": "q", "documents": ["a"]}),
    ("/predict", {"inputs": ["q", "a"]}),
], ids=["tei-rerank", "cohere-rerank", "predict"])
def test_classifier_routes_on_an_embedding_model_say_it_is_not_a_classifier(server, path, body):
    answer = requests.post(f"http://{server.http_url}{path}", json=body, timeout=30)
    assert answer.status_code == 400
    error = answer.json()["error"]
    message = error["message"] if path.startswith("/v1/") else error
    assert f"needs a classifier (cross-encoder); the served model '{TEXT_MODEL}' is an embedding model" in message
