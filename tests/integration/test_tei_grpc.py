"""TEI's gRPC services (``tei.v1``) end to end: a real server process serving MiniLM and a
reranker, called through stubs generated from ``protos/tei.proto``, checked against transformers
and sentence-transformers, and against the same server's TEI HTTP routes for the same input."""

from __future__ import annotations

import json
import queue
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests

from dietserve.runtime.manifest import Manifest
from dietserve.server._proto import tei_pb2 as tei
from dietserve.server._proto import tei_pb2_grpc as tei_grpc

from .reference import reference_hidden
from .scrape import metrics, total, wait_for
from .server_process import ServerProcess
from .test_rerank import cross_encoder_scores, transformers_logits
from .test_sentence_embedding import _reference_embeddings, sentence_transformers_length
from .test_tei_routes import SENTENCES, UNICODE, _tokenizer

pytestmark = pytest.mark.slow
SAME = 1e-6  # one server, one input: two wires must give the same numbers
REFERENCE_ATOL = 1e-4
QUERY = "What do people eat?"


@pytest.fixture(scope="module")
def served(minilm_artifact: Path, reranker_artifact: tuple[Path, Path]):
    """(the server, MiniLM's name, the reranker's name, the reranker's checkpoint folder)."""
    folder, reranker = reranker_artifact
    process = ServerProcess(None, "--artifact", str(minilm_artifact), "--artifact", str(reranker), model_name=None)
    yield process, Manifest.read(minilm_artifact).model_name, Manifest.read(reranker).model_name, folder
    process.stop()


@pytest.fixture(scope="module")
def channel(served):
    with grpc.insecure_channel(served[0].grpc_url) as opened:
        yield opened


def _http(server: ServerProcess, path: str, body: dict):
    answer = requests.post(f"http://{server.http_url}{path}", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_embed_gives_the_references_embedding_and_the_http_routes(served, channel, minilm_reference):
    server = served[0]
    stub = tei_grpc.EmbedStub(channel)
    answers = [stub.Embed(tei.EmbedRequest(inputs=text)) for text in SENTENCES]
    embeddings = np.array([list(answer.embeddings) for answer in answers])
    reference, _ = _reference_embeddings(minilm_reference, SENTENCES)
    np.testing.assert_allclose(embeddings, reference, atol=REFERENCE_ATOL)
    np.testing.assert_allclose(embeddings, _http(server, "/embed", {"inputs": SENTENCES}), atol=SAME)
    metadata = answers[0].metadata
    assert metadata.compute_chars == len(SENTENCES[0])
    assert metadata.compute_tokens == len(_tokenizer()(SENTENCES[0])["input_ids"])
    assert metadata.total_time_ns >= metadata.inference_time_ns > 0
    short = stub.Embed(tei.EmbedRequest(inputs=SENTENCES[0], dimensions=16)).embeddings
    expected = reference[0, :16] / np.linalg.norm(reference[0, :16])
    np.testing.assert_allclose(short, expected, atol=REFERENCE_ATOL)


def test_a_stream_answers_in_order_whether_sent_at_once_or_one_by_one(served, channel):
    stub = tei_grpc.EmbedStub(channel)
    texts = [f"{SENTENCES[i % 3]} number {i}" for i in range(20)]
    unary = [list(stub.Embed(tei.EmbedRequest(inputs=text)).embeddings) for text in texts]
    at_once = [list(answer.embeddings) for answer in stub.EmbedStream(tei.EmbedRequest(inputs=text) for text in texts)]
    np.testing.assert_allclose(at_once, unary, atol=SAME)
    answered: queue.Queue = queue.Queue()

    def one_by_one():  # each message only once the last one's answer is back
        for text in texts[:4]:
            yield tei.EmbedRequest(inputs=text)
            answered.get(timeout=60)

    replies = []
    for reply in stub.EmbedStream(one_by_one()):
        replies.append(list(reply.embeddings))
        answered.put(True)
    np.testing.assert_allclose(replies, unary[:4], atol=SAME)


def test_embed_all_tokenize_and_decode_agree_with_the_reference(served, channel, minilm_reference):
    embed, tokenize = tei_grpc.EmbedStub(channel), tei_grpc.TokenizeStub(channel)
    answer = embed.EmbedAll(tei.EmbedAllRequest(inputs=SENTENCES[1]))
    hidden = np.array([list(token.embeddings) for token in answer.token_embeddings])
    tokenizer = _tokenizer()
    encoded = tokenizer([SENTENCES[1]], return_tensors="np")
    expected = reference_hidden(minilm_reference, encoded["input_ids"], encoded["attention_mask"],
                                encoded["token_type_ids"])[0]
    assert hidden.shape == expected.shape  # no padding rows
    np.testing.assert_allclose(hidden, expected, atol=REFERENCE_ATOL)
    encoded = tokenizer(UNICODE, return_offsets_mapping=True)
    tokens = tokenize.Tokenize(tei.EncodeRequest(inputs=UNICODE, add_special_tokens=True)).tokens
    assert [token.id for token in tokens] == encoded["input_ids"]
    assert not tokens[0].HasField("start") and tokens[0].special
    start, stop = encoded["offset_mapping"][1]
    assert (tokens[1].start, tokens[1].stop) == (len(UNICODE[:start].encode()), len(UNICODE[:stop].encode()))
    assert tokens == _grpc_tokens(_http(served[0], "/tokenize", {"inputs": UNICODE})[0])
    ids = encoded["input_ids"]
    assert tokenize.Decode(tei.DecodeRequest(ids=ids, skip_special_tokens=True)).text == \
        tokenizer.decode(ids, skip_special_tokens=True)
    streamed = tokenize.DecodeStream(tei.DecodeRequest(ids=ids) for _ in range(3))
    assert [reply.text for reply in streamed] == [tokenizer.decode(ids)] * 3


def _grpc_tokens(entries: list[dict]) -> list:
    return [tei.SimpleToken(**{key: value for key, value in entry.items() if value is not None})
            for entry in entries]


def test_rerank_and_predict_score_as_the_cross_encoder_does(served, channel):
    _, _, reranker, folder = served
    texts = ["A man is eating food.", "Pizza is popular.", "The sky is blue.", "A child eats an apple."]
    reference = cross_encoder_scores(folder, [(QUERY, text) for text in texts])
    named = (("model", reranker),)
    answer = tei_grpc.RerankStub(channel).Rerank(tei.RerankRequest(query=QUERY, texts=texts, return_text=True),
                                                 metadata=named)
    ranks = answer.ranks
    from transformers import AutoTokenizer

    pairs = AutoTokenizer.from_pretrained(str(folder))([QUERY] * len(texts), texts)["input_ids"]
    assert answer.metadata.compute_tokens == sum(map(len, pairs)) and answer.metadata.total_time_ns > 0
    assert [rank.index for rank in ranks] == list(np.argsort(-reference))
    np.testing.assert_allclose([rank.score for rank in ranks], np.sort(reference)[::-1], atol=REFERENCE_ATOL)
    assert [rank.text for rank in ranks] == [texts[rank.index] for rank in ranks]
    streamed = tei_grpc.RerankStub(channel).RerankStream(
        (tei.RerankStreamRequest(query=QUERY, text=text) for text in texts), metadata=named).ranks
    assert [(rank.index, rank.HasField("text")) for rank in streamed] == [(rank.index, False) for rank in ranks]
    # the only classifier served: no metadata needed
    predicted = tei_grpc.PredictStub(channel).PredictPair(tei.PredictPairRequest(inputs=[QUERY, texts[0]]))
    np.testing.assert_allclose(predicted.predictions[0].score, reference[0], atol=REFERENCE_ATOL)
    raw = tei_grpc.PredictStub(channel).Predict(tei.PredictRequest(inputs=QUERY, raw_scores=True)).predictions
    np.testing.assert_allclose(raw[0].score, transformers_logits(folder, [QUERY])[0, 0], atol=REFERENCE_ATOL)
    assert raw[0].label == json.loads((folder / "config.json").read_text())["id2label"]["0"]


def test_health_answers_for_teis_services(channel):
    """As TEI's server does, each service's name is SERVING once the models are ready."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("tei.v1.Info", "tei.v1.Embed", "tei.v1.Predict", "tei.v1.Rerank", "tei.v1.Tokenize"):
        status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING, service


def test_info_describes_each_served_model(served, channel):
    server, minilm, reranker, _ = served
    info = tei_grpc.InfoStub(channel).Info(tei.InfoRequest(), metadata=(("model", minilm),))
    assert info.model_type == tei.MODEL_TYPE_EMBEDDING and info.model_id == minilm
    assert info.max_input_length == sentence_transformers_length() and info.model_dtype == "float32"
    other = tei_grpc.InfoStub(channel).Info(tei.InfoRequest(), metadata=(("model", reranker),))
    assert other.model_type == tei.MODEL_TYPE_RERANKER


@pytest.mark.parametrize(("call", "code", "named"), [
    (lambda channel: tei_grpc.EmbedStub(channel).Embed(tei.EmbedRequest(inputs="hi", prompt_name="query")),
     grpc.StatusCode.INVALID_ARGUMENT, "prompt_name"),
    (lambda channel: tei_grpc.EmbedStub(channel).Embed(tei.EmbedRequest(inputs="hi"), metadata=(("model", "nope"),)),
     grpc.StatusCode.NOT_FOUND, "nope"),
    (lambda channel: tei_grpc.EmbedStub(channel).EmbedSparse(tei.EmbedSparseRequest(inputs="hi")),
     grpc.StatusCode.INVALID_ARGUMENT, "/embed_sparse needs a sparse encoder"),
    (lambda channel: tei_grpc.PredictStub(channel).PredictPair(tei.PredictPairRequest(inputs=["a", "b", "c"])),
     grpc.StatusCode.INVALID_ARGUMENT, "two texts"),
    (lambda channel: tei_grpc.EmbedStub(channel).Embed(tei.EmbedRequest(inputs="word " * 600)),
     grpc.StatusCode.INVALID_ARGUMENT, "truncate"),
    (lambda channel: list(tei_grpc.EmbedStub(channel).EmbedStream(
        iter([tei.EmbedRequest(inputs="fine"), tei.EmbedRequest(inputs="x", dimensions=9999)]))),
     grpc.StatusCode.INVALID_ARGUMENT, "dimensions"),
], ids=["unknown-prompt", "unknown-model", "dense-model-sparse-call", "three-texts-pair", "too-long",
        "stream-second-message"])
def test_errors_name_what_was_wrong_and_the_server_keeps_serving(served, channel, call, code, named):
    with pytest.raises(grpc.RpcError) as raised:
        call(channel)
    assert raised.value.code() == code and named in raised.value.details(), raised.value.details()
    assert len(tei_grpc.EmbedStub(channel).Embed(tei.EmbedRequest(inputs="still serving")).embeddings) == 384


def test_a_long_text_is_cut_when_truncate_asks(served, channel):
    stub = tei_grpc.EmbedStub(channel)
    long = stub.Embed(tei.EmbedRequest(inputs="word " * 600, truncate=True)).embeddings
    left = stub.Embed(tei.EmbedRequest(inputs="word " * 600 + "end", truncate=True,
                                       truncation_direction=tei.TRUNCATION_DIRECTION_LEFT)).embeddings
    http = _http(served[0], "/embed", {"inputs": "word " * 600 + "end", "truncate": True,
                                       "truncation_direction": "left"})
    assert len(long) == 384
    np.testing.assert_allclose(left, http[0], atol=SAME)


def test_a_stream_the_client_cancels_stops_its_work(served, channel):
    """The stream's queued and running messages are cancelled with it (up to 64 run ahead of the
    answers): little more than a batch is computed after the cancel, and the next call is served."""
    long_text = f"{SENTENCES[1]} " * 20
    tokens_each = len(_tokenizer()(long_text)["input_ids"])
    computed = lambda: total(metrics(served[0]), "dietserve_computed_tokens_total")  # noqa: E731
    before = computed()
    replies = tei_grpc.EmbedStub(channel).EmbedStream(tei.EmbedRequest(inputs=long_text) for _ in range(200))
    for count, _ in enumerate(replies, 1):
        if count == 3:
            replies.cancel()
            break
    assert replies.code() == grpc.StatusCode.CANCELLED
    wait_for(lambda: metrics(served[0]).get(("dietserve_inflight_requests", ())) == 0, "no request in flight")
    time.sleep(1)  # a batch's metrics are recorded just after its answers
    assert computed() - before < 30 * tokens_each  # not the 64 messages read ahead
    assert len(tei_grpc.EmbedStub(channel).Embed(tei.EmbedRequest(inputs="still serving")).embeddings) == 384


def test_a_pair_is_cut_on_the_left_when_asked(served, channel):
    """``truncation_direction`` left: a pair's longest text loses its first tokens, as transformers'
    tokenizer cuts it with ``truncation_side`` left (its score differs from the right cut's), over
    HTTP's /rerank and /predict and gRPC's Rerank and PredictPair."""
    _, _, reranker, folder = served
    named = (("model", reranker),)
    longest = tei_grpc.InfoStub(channel).Info(tei.InfoRequest(), metadata=named).max_input_length
    long_text = "A man is eating food. " * 60 + "The sky is blue over the sea. " * 60
    expected = {side: 1 / (1 + np.exp(-transformers_logits(folder, [(QUERY, long_text)], longest, side)[0, 0]))
                for side in ("left", "right")}
    assert abs(expected["left"] - expected["right"]) > 1e-3
    options = {"truncate": True, "truncation_direction": "left"}
    ranked = _http(served[0], "/rerank", {"query": QUERY, "texts": [long_text], **options})
    predicted = _http(served[0], "/predict", {"inputs": [QUERY, long_text], **options})
    left = {"truncate": True, "truncation_direction": tei.TRUNCATION_DIRECTION_LEFT}
    ranks = tei_grpc.RerankStub(channel).Rerank(tei.RerankRequest(query=QUERY, texts=[long_text], **left),
                                                metadata=named).ranks
    pair = tei_grpc.PredictStub(channel).PredictPair(tei.PredictPairRequest(inputs=[QUERY, long_text], **left),
                                                     metadata=named).predictions
    for score in (ranked[0]["score"], predicted[0]["score"], ranks[0].score, pair[0].score):
        assert abs(score - expected["left"]) < REFERENCE_ATOL, (score, expected)
