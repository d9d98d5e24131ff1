"""An embedder and a reranker in one server (``serve --artifact A --artifact B``): each answers
as it does alone (the embedder as its engine run in this process, the reranker as
sentence-transformers' CrossEncoder), both are listed on both wires, requests to both at once all
succeed, and flags that cannot hold with several artifacts are refused at start."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as triton_grpc

from dietserve.compile.artifact import CompileRequest, compile_artifact
from dietserve.runtime.embedder import artifact_tokenizer

from .server_process import REPO_ROOT, ServerProcess
from .test_classification import classification_folder
from .test_rerank import DOCUMENTS, QUERY, cross_encoder_scores, transformers_logits

pytestmark = pytest.mark.slow
EMBEDDER, RERANKER = "all-MiniLM-L6-v2", "reranker"  # the manifests' model names
SENTENCES = ["A man is eating food.", "The new movie is awesome and everyone should see it twice.", "Hi"]
EMBEDDING_ATOL, SCORE_ATOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def server(minilm_artifact: Path, reranker_artifact):
    process = ServerProcess(None, "--artifact", str(minilm_artifact), "--artifact", str(reranker_artifact[1]),
                            model_name=None)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def expected_embeddings(minilm_engine) -> np.ndarray:
    """The embedder's engine run in this process on the checkpoint's tokenization."""
    encoded = artifact_tokenizer(minilm_engine).encode(SENTENCES)
    return minilm_engine.execute(encoded.input_ids, encoded.attention_mask, encoded.token_type_ids).sentence_embedding


@pytest.fixture(scope="module")
def expected_scores(reranker_artifact) -> np.ndarray:
    return cross_encoder_scores(reranker_artifact[0], [(QUERY, document) for document in DOCUMENTS])


def _post(server: ServerProcess, path: str, body: dict) -> requests.Response:
    return requests.post(f"http://{server.http_url}{path}", json=body, timeout=60)


def _embeddings(server: ServerProcess, model: str = EMBEDDER) -> np.ndarray:
    answer = _post(server, "/v1/embeddings", {"model": model, "input": SENTENCES})
    assert answer.status_code == 200, answer.text
    return np.array([entry["embedding"] for entry in answer.json()["data"]])


def _rerank_scores(server: ServerProcess, path: str = "/rerank", **fields) -> np.ndarray:
    answer = _post(server, path, {"query": QUERY, "texts": DOCUMENTS, **fields})
    assert answer.status_code == 200, answer.text
    scores = np.zeros(len(DOCUMENTS))
    for entry in answer.json():
        scores[entry["index"]] = entry["score"]
    return scores


def test_each_model_answers_as_it_does_alone(server, expected_embeddings, expected_scores):
    np.testing.assert_allclose(_embeddings(server), expected_embeddings, rtol=0, atol=EMBEDDING_ATOL)
    np.testing.assert_allclose(_embeddings(server, EMBEDDER + "-text"), expected_embeddings, rtol=0,
                               atol=EMBEDDING_ATOL)
    # /rerank names no model: the only classifier served answers, or the one named.
    np.testing.assert_allclose(_rerank_scores(server), expected_scores, rtol=0, atol=SCORE_ATOL)
    np.testing.assert_allclose(_rerank_scores(server, model=RERANKER), expected_scores, rtol=0, atol=SCORE_ATOL)
    np.testing.assert_allclose(_rerank_scores(server, f"/rerank?model={RERANKER}-text"), expected_scores, rtol=0,
                               atol=SCORE_ATOL)
    cohere = _post(server, "/v1/rerank", {"model": RERANKER, "query": QUERY, "documents": DOCUMENTS}).json()
    np.testing.assert_allclose(sorted(r["relevance_score"] for r in cohere["results"]), np.sort(expected_scores),
                               rtol=0, atol=SCORE_ATOL)


def test_embeddings_without_a_model_take_the_only_embedding_model(server, expected_embeddings):
    answer = _post(server, "/v1/embeddings", {"input": SENTENCES})  # the reranker is no candidate
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == EMBEDDER
    got = np.array([entry["embedding"] for entry in answer.json()["data"]])
    np.testing.assert_allclose(got, expected_embeddings, rtol=0, atol=EMBEDDING_ATOL)


def test_routes_refuse_the_other_kind_of_model_by_name(server):
    embedding_of_reranker = _post(server, "/v1/embeddings", {"model": RERANKER, "input": ["Hi"]})
    assert embedding_of_reranker.status_code == 400
    assert f"'{RERANKER}' is a classifier" in embedding_of_reranker.json()["error"]["message"]
    rerank_of_embedder = _post(server, f"/rerank?model={EMBEDDER}", {"query": QUERY, "texts": ["a"]})
    assert rerank_of_embedder.status_code == 400
    assert f"the served model '{EMBEDDER}-text' is an embedding model" in rerank_of_embedder.json()["error"]
    unknown = _post(server, "/rerank", {"model": "rerank-9", "query": QUERY, "texts": ["a"]})
    assert unknown.status_code == 404 and "unknown model 'rerank-9'" in unknown.json()["error"]


def test_both_models_are_listed_on_both_wires(server):
    names = {EMBEDDER, EMBEDDER + "-text", RERANKER, RERANKER + "-text"}
    with triton_grpc.InferenceServerClient(server.grpc_url) as client:
        index = client.get_model_repository_index(as_json=True)["models"]
        assert {entry["name"] for entry in index} == names and {entry["state"] for entry in index} == {"READY"}
        outputs = {name: [o.name for o in client.get_model_metadata(name).outputs] for name in names}
        assert outputs[EMBEDDER] == outputs[EMBEDDER + "-text"] == ["last_hidden_state", "sentence_embedding"]
        assert outputs[RERANKER] == outputs[RERANKER + "-text"] == ["last_hidden_state", "logits"]
        assert client.get_model_config(RERANKER).config.max_batch_size == 8
        _rerank_scores(server)
        statistics = {s.name: s for s in client.get_inference_statistics().model_stats}
        assert set(statistics) == names and statistics[RERANKER + "-text"].inference_count >= len(DOCUMENTS)
    listed = requests.get(f"http://{server.http_url}/v1/models", timeout=30).json()["data"]
    assert {entry["id"] for entry in listed} == names
    v2 = requests.get(f"http://{server.http_url}/v2/models/{RERANKER}-text/config", timeout=30).json()
    assert v2["input"][0]["dims"] == [2]


def test_concurrent_requests_to_both_models_all_succeed(server, expected_embeddings, expected_scores):
    def one(index: int) -> np.ndarray:
        return _embeddings(server) if index % 2 else _rerank_scores(server)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(24)))
    for index, answer in enumerate(answers):
        if index % 2:
            np.testing.assert_allclose(answer, expected_embeddings, rtol=0, atol=EMBEDDING_ATOL)
        else:
            np.testing.assert_allclose(answer, expected_scores, rtol=0, atol=SCORE_ATOL)


@pytest.fixture(scope="module")
def two_classifiers(tmp_path_factory, cache_dir: Path, reranker_artifact):
    """The reranker beside a three-label classifier, 'nli': TEI's routes must be told which."""
    folder = classification_folder(tmp_path_factory.mktemp("several-classifiers") / "nli", 3)
    nli = compile_artifact(CompileRequest(model=str(folder), max_batch=8), cache_dir)
    process = ServerProcess(None, "--artifact", str(reranker_artifact[1]), "--artifact", str(nli), model_name=None)
    yield folder, process
    process.stop()


def test_with_several_classifiers_tei_routes_need_the_model_named(two_classifiers, expected_scores):
    folder, server = two_classifiers
    unnamed = _post(server, "/rerank", {"query": QUERY, "texts": DOCUMENTS})
    assert unnamed.status_code == 400
    assert "several classifiers ('reranker', 'nli'): name one with 'model'" in unnamed.json()["error"]
    no_embedder = _post(server, "/v1/embeddings", {"input": SENTENCES})
    assert no_embedder.status_code == 400
    assert "embedding models served: none" in no_embedder.json()["error"]["message"]
    np.testing.assert_allclose(_rerank_scores(server, f"/rerank?model={RERANKER}"), expected_scores, rtol=0,
                               atol=SCORE_ATOL)
    pairs = [("A man is eating food.", "A man eats."), ("A man is eating food.", "The sky is green.")]
    answer = _post(server, "/predict", {"model": "nli", "inputs": [list(pair) for pair in pairs], "raw_scores": True})
    assert answer.status_code == 200, answer.text
    got = np.array([sorted(p["score"] for p in row) for row in answer.json()])
    np.testing.assert_allclose(got, np.sort(transformers_logits(folder, pairs), axis=1), rtol=0, atol=SCORE_ATOL)


def _refused(*flags: str) -> str:
    done = subprocess.run([sys.executable, "-m", "dietserve", "serve", "--port", "0", "--metrics-port", "0",
                           "--http-port", "0", *flags], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done.stderr[-2000:]
    return done.stderr


def test_a_name_two_artifacts_share_is_refused_at_start(minilm_artifact: Path):
    message = _refused("--artifact", str(minilm_artifact), "--artifact", str(minilm_artifact))
    assert f"two artifacts would both serve a model named '{EMBEDDER}'" in message


def test_model_name_with_several_artifacts_is_refused(minilm_artifact: Path, reranker_artifact):
    message = _refused("--artifact", str(minilm_artifact), "--artifact", str(reranker_artifact[1]),
                       "--model-name", "x")
    assert "--model-name names the one artifact served; 2 are given" in message


def test_a_model_repository_serves_each_subfolder_and_refuses_an_empty_one(tmp_path: Path, minilm_artifact: Path):
    assert "has no artifact" in _refused("--model-repository", str(tmp_path))
    for name in ("a", "b"):  # two subfolders holding one artifact: both read, so their names clash
        (tmp_path / name).symlink_to(minilm_artifact, target_is_directory=True)
    assert f"model named '{EMBEDDER}'" in _refused("--model-repository", str(tmp_path))


def test_one_traffic_file_for_several_models_and_retune_without_a_store_are_refused(tmp_path: Path,
                                                                                   minilm_artifact: Path):
    store = tmp_path / "store"
    message = _refused("--artifact", str(minilm_artifact), "--artifact-store", str(store),
                       "--traffic-file", str(tmp_path / "traffic.json"))
    assert "--traffic-file records one artifact's traffic" in message and "with 2 artifacts" in message
    assert "--retune needs --artifact-store" in _refused("--artifact", str(minilm_artifact), "--retune")


def test_tei_root_route_follows_the_body_and_tei_routes_pick_their_kind(server, expected_embeddings,
                                                                        expected_scores):
    # /embed names no model: the only embedding model answers, as /rerank takes the only classifier.
    embedded = _post(server, "/embed", {"inputs": SENTENCES})
    assert embedded.status_code == 200, embedded.text
    np.testing.assert_allclose(embedded.json(), expected_embeddings, rtol=0, atol=EMBEDDING_ATOL)
    np.testing.assert_allclose(_rerank_scores(server, "/"), expected_scores, rtol=0, atol=SCORE_ATOL)
    unnamed = _post(server, "/", {"inputs": SENTENCES})  # embed or predict: the kinds served differ
    assert unnamed.status_code == 400 and "serves embedding models and classifiers" in unnamed.json()["error"]
    np.testing.assert_allclose(_post(server, "/", {"inputs": SENTENCES, "model": EMBEDDER}).json(),
                               expected_embeddings, rtol=0, atol=EMBEDDING_ATOL)
    pair = [QUERY, DOCUMENTS[0]]
    predicted = _post(server, f"/invocations?model={RERANKER}", {"inputs": pair, "raw_scores": True})
    assert predicted.status_code == 200, predicted.text
    assert predicted.json() == _post(server, "/predict", {"inputs": pair, "raw_scores": True}).json()
    info = requests.get(f"http://{server.http_url}/info?model={RERANKER}", timeout=30).json()
    assert info["model_id"] == RERANKER and list(info["model_type"]) == ["reranker"]
    wrong = _post(server, f"/embed?model={RERANKER}", {"inputs": ["Hi"]})
    assert wrong.status_code == 400 and f"'{RERANKER}' is a classifier" in wrong.json()["error"]
