"""Bounded work under abuse, against a real server process: health answers while a 16 MiB text
is handled, the concurrency cap refuses cleanly and is counted, and a request whose caller has
gone (cancelled, or its deadline passed) is never computed."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from dietserve.runtime.embedder import artifact_tokenizer

from .scrape import metrics, wait_for
from .server_process import ServerProcess

pytestmark = pytest.mark.slow
MODEL = "limits"
CAP = 3
ATOL = 1e-4


@pytest.fixture(scope="module")
def server(minilm_artifact: Path):
    process = ServerProcess(minilm_artifact, "--no-batching", "--max-concurrent-rpcs", str(CAP),
                            "--max-request-bytes", str(20 << 20), model_name=MODEL)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def channel(server: ServerProcess):
    with grpc.insecure_channel(server.grpc_url, options=[("grpc.max_send_message_length", 20 << 20)]) as c:
        yield c


def _ids_request(ids: np.ndarray) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="input_ids", datatype="INT64", shape=ids.shape)
    request.raw_input_contents.append(np.ascontiguousarray(ids, "<i8").tobytes())
    request.outputs.add(name="sentence_embedding")
    return request


def _embedding(response: service_pb2.ModelInferResponse) -> np.ndarray:
    return np.frombuffer(response.raw_output_contents[0], "<f4").reshape(response.outputs[0].shape)


def _inflight(server: ServerProcess) -> float:
    return metrics(server)[("dietserve_inflight_requests", ())]


def _statistics(channel) -> service_pb2.ModelStatistics:
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    return stub.ModelStatistics(service_pb2.ModelStatisticsRequest(name=MODEL), timeout=10).model_stats[0]


def test_health_answers_within_200_ms_while_a_16_mib_text_is_handled(server, channel, minilm_artifact, minilm_engine):
    sentence = "The quick brown fox jumps over the lazy dog near the river bank. "
    text = (sentence * ((16 << 20) // len(sentence))).encode()
    request = service_pb2.ModelInferRequest(model_name=MODEL + "-text")
    request.inputs.add(name="text", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(len(text).to_bytes(4, "little") + text)
    request.outputs.add(name="sentence_embedding")
    request.parameters["truncate"].bool_param = True  # the server refuses over-long text by default
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    latencies = []
    with grpc.insecure_channel(server.grpc_url) as probe_channel:  # a probe has its own connection
        health = health_pb2_grpc.HealthStub(probe_channel)
        health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        pending = stub.ModelInfer.future(request, timeout=120)
        while not pending.done():
            started = time.perf_counter()
            status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
            latencies.append(time.perf_counter() - started)
            assert status == health_pb2.HealthCheckResponse.SERVING
    embedding = _embedding(pending.result())
    assert latencies, "the request finished before a health check could be sent"
    assert max(latencies) < 0.2, f"health took up to {max(latencies) * 1e3:.0f} ms"
    # Truncation keeps the first tokens the model's text bound allows, which a 100 kB prefix already holds.
    tokenizer = artifact_tokenizer(minilm_engine)
    encoded = tokenizer.encode([text[:100_000].decode()])
    assert encoded.input_ids.shape[1] == tokenizer.max_length
    expected = minilm_engine.run(encoded.input_ids, encoded.attention_mask, encoded.token_type_ids)
    np.testing.assert_allclose(embedding, expected.sentence_embedding, atol=ATOL)


def test_the_concurrency_cap_refuses_cleanly_and_is_counted(server, channel, minilm_engine):
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    big = np.full((8, 512), 2000, np.int64)
    refused_before = metrics(server).get(
        ("dietserve_requests_total", (("code", "RESOURCE_EXHAUSTED"), ("method", "ModelInfer"))), 0.0)
    running = [stub.ModelInfer.future(_ids_request(big), timeout=120) for _ in range(CAP)]
    wait_for(lambda: _inflight(server) == CAP, f"{CAP} requests in flight", interval=0.01)
    with pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(_ids_request(np.full((1, 4), 2000)), timeout=30)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"limit {CAP}" in refused.value.details()
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes are never capped
    # One cap for both wires: the gRPC calls in flight fill it for HTTP too; HTTP probes pass.
    over_http = requests.post(f"http://{server.http_url}/v1/embeddings", json={"model": MODEL, "input": "hi"},
                              timeout=30)
    assert over_http.status_code == 429 and f"limit {CAP}" in over_http.json()["error"]["message"]
    assert requests.get(f"http://{server.http_url}/health", timeout=5).status_code == 200
    expected = minilm_engine.run(big).sentence_embedding
    for future in running:
        np.testing.assert_allclose(_embedding(future.result()), expected, atol=ATOL)
    refused_after = metrics(server)[
        ("dietserve_requests_total", (("code", "RESOURCE_EXHAUSTED"), ("method", "ModelInfer")))]
    assert refused_after == refused_before + 1
    small = np.full((1, 4), 2000)
    np.testing.assert_allclose(_embedding(stub.ModelInfer(_ids_request(small), timeout=30)),
                               minilm_engine.run(small).sentence_embedding, atol=ATOL)


def test_cancelled_and_expired_requests_are_not_computed(server, channel):
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    before = _statistics(channel)
    big = stub.ModelInfer.future(_ids_request(np.full((8, 512), 2000, np.int64)), timeout=120)
    wait_for(lambda: _inflight(server) == 1, "1 request(s) in flight", interval=0.01)
    with pytest.raises(grpc.RpcError) as expired:  # queued behind the big one past its deadline
        stub.ModelInfer(_ids_request(np.full((2, 16), 2000)), timeout=0.3)
    assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    abandoned = stub.ModelInfer.future(_ids_request(np.full((3, 16), 2000)), timeout=120)
    wait_for(lambda: _inflight(server) == 2, "2 request(s) in flight", interval=0.01)
    abandoned.cancel()
    big.result()
    wait_for(lambda: _inflight(server) == 0, "0 request(s) in flight", interval=0.01)
    after = _statistics(channel)
    assert after.execution_count - before.execution_count == 1, "only the big request should have run"
    assert after.inference_count - before.inference_count == 8
    cancelled = metrics(server).get(("dietserve_requests_total", (("code", "CANCELLED"), ("method", "ModelInfer"))))
    assert cancelled is not None and cancelled >= 1
