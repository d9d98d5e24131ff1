"""The gRPC server, end to end: a real server process, real clients (tritonclient, KServe's),
answers checked against the same artifact run directly through the engine."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from dietserve.model.tokenizer import TextTokenizer
from dietserve.runtime.embedder import artifact_tokenizer

from .scrape import metrics, metrics_after_batches, total
from .server_process import ServerProcess

pytestmark = pytest.mark.slow
MODEL = "minilm"
TEXT_MODEL = "minilm-text"
SENTENCES = ["A man is eating food.", "The new movie is awesome and everyone should see it twice.", "Hi"]
ATOL = 1e-4  # batching pads rows: masked positions add exact zeros, summation order may differ


@pytest.fixture(scope="module")
def server(minilm_artifact: Path):
    process = ServerProcess(minilm_artifact, "--max-queue-delay-ms", "5", "--max-request-bytes", str(1 << 20),
                            "--max-response-bytes", str(1 << 20), model_name=MODEL)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess):
    with triton.InferenceServerClient(server.grpc_url) as c:
        yield c


@pytest.fixture(scope="module")
def stub(server: ServerProcess):
    channel = grpc.insecure_channel(server.grpc_url)
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def tokenizer(minilm_engine) -> TextTokenizer:
    return artifact_tokenizer(minilm_engine)


def ids_input(array: np.ndarray, name: str = "input_ids", datatype: str = "INT64") -> triton.InferInput:
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def infer_ok_count(server: ServerProcess) -> float:
    return metrics(server).get(("dietserve_requests_total", (("code", "OK"), ("method", "ModelInfer"))), 0.0)


# ---------------------------------------------------------------------------- health, metadata


def test_health_and_metadata(client, minilm_engine):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL) and client.is_model_ready(TEXT_MODEL)
    server_metadata = client.get_server_metadata()
    assert server_metadata.name == "dietserve" and "model_configuration" in server_metadata.extensions
    hidden = minilm_engine.hidden_size
    outputs = {"last_hidden_state": [-1, -1, hidden], "sentence_embedding": [-1, hidden]}
    metadata = client.get_model_metadata(MODEL)
    assert metadata.name == MODEL and list(metadata.versions) == ["1"]
    assert {t.name: (t.datatype, list(t.shape)) for t in metadata.inputs} == {
        "input_ids": ("INT64", [-1, -1]), "attention_mask": ("INT64", [-1, -1]),
        "token_type_ids": ("INT64", [-1, -1])}
    assert {t.name: list(t.shape) for t in metadata.outputs} == outputs
    text_metadata = client.get_model_metadata(TEXT_MODEL)
    assert {t.name: (t.datatype, list(t.shape)) for t in text_metadata.inputs} == {"text": ("BYTES", [-1])}
    assert {t.name: list(t.shape) for t in text_metadata.outputs} == outputs
    # Each config lists only what a client sends (perf_analyzer sends every listed input).
    config = client.get_model_config(MODEL).config
    assert config.name == MODEL and config.max_batch_size == minilm_engine.max_batch
    assert [(i.name, i.optional) for i in config.input] == [
        ("input_ids", False), ("attention_mask", True), ("token_type_ids", True)]
    assert config.dynamic_batching.max_queue_delay_microseconds == 5000
    assert config.parameters["max_sequence_length"].string_value == str(minilm_engine.max_seq_len)
    text_config = client.get_model_config(TEXT_MODEL).config
    assert [(i.name, i.data_type, list(i.dims)) for i in text_config.input] == [("text", 13, [1])]  # TYPE_STRING
    index = client.get_model_repository_index()
    assert [(m.name, m.state) for m in index.models] == [(MODEL, "READY"), (TEXT_MODEL, "READY")]


def test_grpc_health_serving_after_warm_up(server):
    with grpc.insecure_channel(server.grpc_url) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_services(server):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        response = next(stub.ServerReflectionInfo(iter([request]), timeout=10))
        names = {s.name for s in response.list_services_response.service}
    assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= names
    # TEI's services, for grpcurl and Postman beside the v2 one
    assert {"tei.v1.Info", "tei.v1.Embed", "tei.v1.Predict", "tei.v1.Rerank", "tei.v1.Tokenize"} <= names


# ---------------------------------------------------------------------------- inference


def test_infer_token_ids_matches_the_engine(client, tokenizer, minilm_engine):
    encoded = tokenizer.encode(SENTENCES)  # padded rows with a real mask
    inputs = [ids_input(encoded.input_ids), ids_input(encoded.attention_mask, "attention_mask"),
              ids_input(encoded.token_type_ids, "token_type_ids")]
    result = client.infer(MODEL, inputs, request_id="ids-1")
    expected = minilm_engine.run(encoded.input_ids, encoded.attention_mask, encoded.token_type_ids)
    np.testing.assert_allclose(result.as_numpy("last_hidden_state"), expected.last_hidden_state, atol=ATOL)
    np.testing.assert_allclose(result.as_numpy("sentence_embedding"), expected.sentence_embedding, atol=ATOL)
    assert result.get_response().id == "ids-1"


def test_infer_int32_ids_and_unknown_parameters(client, tokenizer, minilm_engine):
    encoded = tokenizer.encode(SENTENCES[:1])
    result = client.infer(MODEL, [ids_input(encoded.input_ids.astype(np.int32), datatype="INT32")],
                          parameters={"priority_hint": "high", "custom_flag": True})
    expected = minilm_engine.run(encoded.input_ids)
    np.testing.assert_allclose(result.as_numpy("sentence_embedding"), expected.sentence_embedding, atol=ATOL)


def test_infer_text_matches_the_engine_and_honours_requested_outputs(client, tokenizer, minilm_engine):
    text = triton.InferInput("text", [len(SENTENCES)], "BYTES")
    text.set_data_from_numpy(np.array([s.encode() for s in SENTENCES], dtype=object))
    result = client.infer(TEXT_MODEL, [text], outputs=[triton.InferRequestedOutput("sentence_embedding")])
    encoded = tokenizer.encode(SENTENCES)
    expected = minilm_engine.run(encoded.input_ids, encoded.attention_mask, encoded.token_type_ids)
    np.testing.assert_allclose(result.as_numpy("sentence_embedding"), expected.sentence_embedding, atol=ATOL)
    assert result.as_numpy("last_hidden_state") is None
    assert [o.name for o in result.get_response().outputs] == ["sentence_embedding"]


def test_typed_contents_are_accepted(stub, minilm_engine):
    ids = np.array([[101, 7592, 2088, 102]], dtype=np.int64)
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    tensor = request.inputs.add(name="input_ids", datatype="INT64", shape=ids.shape)
    tensor.contents.int64_contents.extend(ids.ravel().tolist())
    request.outputs.add(name="sentence_embedding")
    response = stub.ModelInfer(request, timeout=30)
    (raw,) = response.raw_output_contents
    embedding = np.frombuffer(raw, dtype="<f4").reshape(response.outputs[0].shape)
    np.testing.assert_allclose(embedding, minilm_engine.run(ids).sentence_embedding, atol=ATOL)


def test_kserve_client(server, minilm_engine):
    ids = [[101, 7592, 2088, 102, 0], [101, 2023, 2003, 1037, 102]]
    script = Path(__file__).parent / "clients" / "kserve_infer.py"
    completed = subprocess.run([sys.executable, str(script), server.grpc_url, MODEL, json.dumps(ids)],
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    answer = json.loads(completed.stdout.strip().splitlines()[-1])
    assert answer["live"] and answer["ready"]
    expected = minilm_engine.run(np.array(ids))
    for label in ("typed", "raw"):
        result = answer["results"][label]
        assert result["id"] == label
        np.testing.assert_allclose(np.array(result["sentence_embedding"]), expected.sentence_embedding, atol=ATOL)
        np.testing.assert_allclose(np.array(result["last_hidden_state"]), expected.last_hidden_state, atol=ATOL)


# ---------------------------------------------------------------------------- bad input


def _request(*tensors: tuple[str, str, list[int], bytes], model: str = MODEL, outputs=()):
    request = service_pb2.ModelInferRequest(model_name=model)
    for name, datatype, shape, raw in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        request.raw_input_contents.append(raw)
    for name in outputs:
        request.outputs.add(name=name)
    return request


def _ids(shape, value=101, dtype="<i8") -> bytes:
    return np.full(shape, value, dtype=dtype).tobytes()


def _text(*items: bytes) -> bytes:
    return b"".join(len(item).to_bytes(4, "little") + item for item in items)


BAD_REQUESTS = {
    "wrong dtype": (_request(("input_ids", "FP32", [1, 4], _ids([1, 4], dtype="<f4"))),
                    grpc.StatusCode.INVALID_ARGUMENT, "datatype FP32"),
    "wrong rank": (_request(("input_ids", "INT64", [4], _ids([4]))),
                   grpc.StatusCode.INVALID_ARGUMENT, "must be 2-D"),
    "mismatched shapes": (_request(("input_ids", "INT64", [1, 4], _ids([1, 4])),
                                   ("attention_mask", "INT64", [1, 5], _ids([1, 5], 1))),
                          grpc.StatusCode.INVALID_ARGUMENT, "attention_mask has shape [1, 5]"),
    "missing input": (_request(("attention_mask", "INT64", [1, 4], _ids([1, 4], 1))), grpc.StatusCode.INVALID_ARGUMENT,
                      "missing input input_ids (INT64 [batch, seq]): got attention_mask"),
    "no inputs": (_request(), grpc.StatusCode.INVALID_ARGUMENT, "missing input"),
    "token out of vocabulary": (_request(("input_ids", "INT64", [1, 3], _ids([1, 3], 999_999))),
                                grpc.StatusCode.INVALID_ARGUMENT, "token id 999999"),
    "negative token": (_request(("input_ids", "INT64", [1, 3], _ids([1, 3], -1))),
                       grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
    "sequence too long": (_request(("input_ids", "INT64", [1, 513], _ids([1, 513]))),
                          grpc.StatusCode.INVALID_ARGUMENT, "sequence length 513 exceeds"),
    "batch too large": (_request(("input_ids", "INT64", [9, 4], _ids([9, 4]))),
                        grpc.StatusCode.INVALID_ARGUMENT, "batch of 9 exceeds"),
    "empty batch": (_request(("input_ids", "INT64", [0, 4], b"")),
                    grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    "raw size mismatch": (_request(("input_ids", "INT64", [2, 4], _ids([1, 4]))),
                          grpc.StatusCode.INVALID_ARGUMENT, "needs 64"),
    "mask not 0/1": (_request(("input_ids", "INT64", [1, 4], _ids([1, 4])),
                              ("attention_mask", "INT64", [1, 4], _ids([1, 4], 7))),
                     grpc.StatusCode.INVALID_ARGUMENT, "only 0 and 1"),
    "unknown input": (_request(("pixels", "FP32", [1, 4], _ids([1, 4], dtype="<f4"))),
                      grpc.StatusCode.INVALID_ARGUMENT, "unknown input 'pixels'"),
    "unknown output": (_request(("input_ids", "INT64", [1, 4], _ids([1, 4])), outputs=["logits"]),
                       grpc.StatusCode.INVALID_ARGUMENT, "unknown output 'logits'"),
    "text to the ids model": (_request(("text", "BYTES", [1], _text(b"hi"))),
                              grpc.StatusCode.INVALID_ARGUMENT, "send text to the model's -text twin"),
    "ids to the text model": (_request(("input_ids", "INT64", [1, 4], _ids([1, 4])), model=TEXT_MODEL),
                              grpc.StatusCode.INVALID_ARGUMENT, "unknown input 'input_ids'"),
    "text not utf-8": (_request(("text", "BYTES", [1], _text(b"\xff\xfe")), model=TEXT_MODEL),
                       grpc.StatusCode.INVALID_ARGUMENT, "not UTF-8"),
    "text wrong dtype": (_request(("text", "INT64", [1], _ids([1])), model=TEXT_MODEL),
                         grpc.StatusCode.INVALID_ARGUMENT, "expected BYTES"),
    "empty text batch": (_request(("text", "BYTES", [0], b""), model=TEXT_MODEL),
                         grpc.StatusCode.INVALID_ARGUMENT, "empty batch"),
    "text batch too large": (_request(("text", "BYTES", [9], _text(*[b"a"] * 9)), model=TEXT_MODEL),
                             grpc.StatusCode.INVALID_ARGUMENT, "batch of 9 texts exceeds"),
    "text with too many elements": (_request(("text", "BYTES", [1], _text(b"a", b"b")), model=TEXT_MODEL),
                                    grpc.StatusCode.INVALID_ARGUMENT, "holds more than 1 BYTES elements"),
    "huge dimension": (_request(("input_ids", "INT64", [1, 1 << 40], _ids([1, 4]))),
                       grpc.StatusCode.INVALID_ARGUMENT, f"sequence length {1 << 40} exceeds"),
    "huge batch": (_request(("input_ids", "INT64", [1 << 62, 4], _ids([1, 4]))),
                   grpc.StatusCode.INVALID_ARGUMENT, f"batch of {1 << 62} exceeds"),
    "negative dimension": (_request(("input_ids", "INT64", [-3, 4], _ids([1, 4]))),
                           grpc.StatusCode.INVALID_ARGUMENT, "negative dimension in shape [-3, 4]"),
    "too many dimensions": (_request(("input_ids", "INT64", [1] * 40 + [4], _ids([1, 4]))),
                            grpc.StatusCode.INVALID_ARGUMENT, "must be 2-D"),
    "reply over the send limit": (_request(("input_ids", "INT64", [8, 128], _ids([8, 128]))),
                                  grpc.StatusCode.RESOURCE_EXHAUSTED, "over this server's limit of 1048576"),
    "oversized message": (_request(("input_ids", "INT64", [1, 200_000], _ids([1, 200_000]))),
                          grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
    "unknown model": (_request(("input_ids", "INT64", [1, 4], _ids([1, 4])), model="gpt-7"),
                      grpc.StatusCode.NOT_FOUND, "unknown model 'gpt-7'; this server serves 'minilm', 'minilm-text'"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_gets_a_named_error_and_the_server_keeps_serving(case, stub, client):
    request, code, message = BAD_REQUESTS[case]
    with pytest.raises(grpc.RpcError) as raised:
        stub.ModelInfer(request, timeout=30)
    assert raised.value.code() == code
    assert message in raised.value.details()
    assert "Traceback" not in raised.value.details()
    good = client.infer(MODEL, [ids_input(np.array([[101, 7592, 102]], dtype=np.int64))])
    assert good.as_numpy("sentence_embedding").shape == (1, 384)


def test_unknown_model_in_metadata_calls_is_not_found(client):
    with pytest.raises(triton.InferenceServerException) as raised:
        client.get_model_metadata("gpt-7")
    assert "unknown model 'gpt-7'" in raised.value.message()
    with pytest.raises(triton.InferenceServerException):
        client.get_model_config(MODEL, model_version="3")


# ---------------------------------------------------------------------------- metrics, concurrency


def test_metrics_count_the_requests(server, client):
    before = metrics(server)
    ok = before.get(("dietserve_requests_total", (("code", "OK"), ("method", "ModelInfer"))), 0.0)
    bad = before.get(("dietserve_requests_total", (("code", "INVALID_ARGUMENT"), ("method", "ModelInfer"))), 0.0)
    health_ok = before.get(("dietserve_requests_total", (("code", "OK"), ("method", "Check"))), 0.0)
    unknown = before.get(("dietserve_requests_total", (("code", "UNIMPLEMENTED"), ("method", "unknown"))), 0.0)
    rows_before = total(before, "dietserve_request_sequence_length_count")
    batches_before = total(before, "dietserve_batch_size_count")
    for length in (3, 17, 40):
        client.infer(MODEL, [ids_input(np.full((2, length), 2000, dtype=np.int64))])
    with pytest.raises(triton.InferenceServerException):
        client.infer(MODEL, [ids_input(np.full((1, 4), 2000, dtype=np.float32), datatype="FP32")])
    with grpc.insecure_channel(server.grpc_url) as channel:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        with pytest.raises(grpc.RpcError):
            channel.unary_unary("/inference.GRPCInferenceService/Nonsense")(b"", timeout=10)
    after = metrics_after_batches(server, batches_before + 3)
    assert after[("dietserve_requests_total", (("code", "OK"), ("method", "Check")))] == health_ok + 1
    assert after[("dietserve_requests_total", (("code", "UNIMPLEMENTED"), ("method", "unknown")))] == unknown + 1
    assert total(after, "dietserve_request_sequence_length_count") == rows_before + 6  # per row, not per request
    assert after[("process_resident_memory_bytes", ())] > 0 and total(after, "dietserve_settled_memory_bytes") > 0
    assert after[("dietserve_requests_total", (("code", "OK"), ("method", "ModelInfer")))] == ok + 3
    assert after[("dietserve_requests_total", (("code", "INVALID_ARGUMENT"), ("method", "ModelInfer")))] == bad + 1
    assert total(after, "dietserve_request_duration_seconds_count") >= ok + bad + 4
    assert ("dietserve_request_duration_seconds_bucket", (("le", "0.0001"), ("model", MODEL))) in after  # sub-ms
    assert total(after, "dietserve_batch_size_count") == batches_before + 3  # one request a batch, sent in turn
    assert total(after, "dietserve_computed_tokens_total") >= 2 * (3 + 17 + 40)
    assert ("dietserve_padding_tokens_total", (("model", MODEL),)) in after
    assert total(after, "dietserve_inflight_requests") == 0
    assert total(after, "dietserve_ready") == 1
    dispatch = {labels: value for (name, labels), value in after.items() if name == "dietserve_kernel_dispatch_total"}
    assert dispatch and all(dict(labels)["variant"] == "default" for labels in dispatch)
    assert any("matmul" in dict(labels)["operator"] for labels in dispatch)


def test_concurrent_clients_get_every_answer_right(server, minilm_engine):
    rng = np.random.default_rng(7)
    # Many requests share a sequence-length bucket, so the batcher pads and batches them together.
    cases = [rng.integers(1000, 5000, size=(int(rng.integers(1, 3)), int(rng.integers(20, 25)))) for _ in range(24)]
    cases += [rng.integers(1000, 5000, size=(1, int(rng.integers(1, 200)))) for _ in range(8)]
    expected = [minilm_engine.run(ids) for ids in cases]
    stats_before = _statistics(server)
    failures: list[str] = []

    def worker(indices: list[int]) -> None:
        with triton.InferenceServerClient(server.grpc_url) as c:
            for index in indices:
                result = c.infer(MODEL, [ids_input(cases[index])])
                for name in ("last_hidden_state", "sentence_embedding"):
                    got, want = result.as_numpy(name), getattr(expected[index], name)
                    if got.shape != want.shape or not np.allclose(got, want, atol=ATOL):
                        failures.append(f"case {index} {name}: max err {np.abs(got - want).max()}")

    threads = [threading.Thread(target=worker, args=(list(range(i, len(cases), 8)),)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not failures
    stats_after = _statistics(server)
    inferred = stats_after.inference_count - stats_before.inference_count
    executions = stats_after.execution_count - stats_before.execution_count
    assert inferred == sum(ids.shape[0] for ids in cases)
    assert executions < len(cases), "concurrent same-bucket requests should have been batched"


def _statistics(server):
    with triton.InferenceServerClient(server.grpc_url) as c:
        return c.get_inference_statistics(MODEL).model_stats[0]
