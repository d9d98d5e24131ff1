"""Server lifecycle under load: SIGTERM drains without losing accepted requests; a full queue
answers RESOURCE_EXHAUSTED; batching off runs every request alone. Real server processes."""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as triton
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .server_process import ServerProcess

pytestmark = pytest.mark.slow
MODEL = "minilm"
ATOL = 1e-4
ANSWERED = re.compile(r"stopped; ModelInfer calls answered: (.+)$", re.MULTILINE)


def _input(ids: np.ndarray) -> triton.InferInput:
    tensor = triton.InferInput("input_ids", list(ids.shape), "INT64")
    tensor.set_data_from_numpy(ids)
    return tensor


def test_sigterm_during_load_loses_no_accepted_request(minilm_artifact: Path, minilm_engine):
    server = ServerProcess(minilm_artifact, "--drain-seconds", "1.0", "--grace-seconds", "60", model_name=MODEL)
    rng = np.random.default_rng(3)
    cases = [rng.integers(1000, 5000, size=(1, int(rng.integers(64, 256)))) for _ in range(6)]
    expected = [minilm_engine.run(ids).sentence_embedding for ids in cases]
    outcomes: list[tuple[float, str]] = []  # (finish time, "ok" | "wrong" | status code name)
    signalled = threading.Event()
    lock = threading.Lock()

    def client_loop(seed: int) -> None:
        with triton.InferenceServerClient(server.grpc_url) as client:
            for attempt in range(1000):
                index = (seed + attempt) % len(cases)
                try:
                    result = client.infer(MODEL, [_input(cases[index])], client_timeout=120)
                    ok = np.allclose(result.as_numpy("sentence_embedding"), expected[index], atol=ATOL)
                    outcome = "ok" if ok else "wrong"
                except triton.InferenceServerException as err:
                    outcome = str(err.status())
                with lock:
                    outcomes.append((time.monotonic(), outcome))
                if outcome != "ok" and signalled.is_set():
                    return

    threads = [threading.Thread(target=client_loop, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    while sum(1 for _, o in outcomes if o == "ok") < 8:
        time.sleep(0.05)
    signal_time = time.monotonic()
    server.terminate()
    signalled.set()
    # While draining, readiness is off but requests are still served.
    with triton.InferenceServerClient(server.grpc_url) as probe:
        deadline = time.monotonic() + 0.8
        saw_not_ready = False
        while time.monotonic() < deadline and not saw_not_ready:
            saw_not_ready = not probe.is_server_ready()
    for thread in threads:
        thread.join(timeout=180)
    assert server.wait(timeout=120) == 0, server.log()

    assert saw_not_ready, "readiness should turn off as soon as SIGTERM arrives"
    kinds = {outcome for _, outcome in outcomes}
    assert "wrong" not in kinds
    # A request the server never took is fine: refused once it stopped accepting (UNAVAILABLE), or
    # cancelled by gRPC because it arrived as the server shut down, before any handler saw it
    # (CANCELLED). Which ones those were, the server's own count says: every call its handlers
    # took must have ended OK and reached a client as "ok"; anything else is a loss.
    assert kinds <= {"ok", "StatusCode.UNAVAILABLE", "StatusCode.CANCELLED"}, kinds
    answered = ANSWERED.search(server.log())
    assert answered, server.log()
    codes = dict((code, int(n)) for code, n in (part.split() for part in answered.group(1).split(", ")))
    assert set(codes) == {"OK"}, codes
    assert codes["OK"] == sum(1 for _, o in outcomes if o == "ok"), (codes, kinds)
    finished_after_signal = [o for t, o in outcomes if t > signal_time and o == "ok"]
    assert finished_after_signal, "requests in flight or arriving during the drain should have completed"


def test_full_queue_answers_resource_exhausted_and_batching_off_runs_alone(minilm_artifact: Path, minilm_engine):
    server = ServerProcess(minilm_artifact, "--no-batching", "--max-queue-rows", "2", model_name=MODEL)
    try:
        ids = np.full((1, 384), 2000, dtype=np.int64)
        expected = minilm_engine.run(ids).sentence_embedding
        outcomes: list[str] = []

        def one() -> None:
            with triton.InferenceServerClient(server.grpc_url) as client:
                try:
                    result = client.infer(MODEL, [_input(ids)], client_timeout=120)
                    ok = np.allclose(result.as_numpy("sentence_embedding"), expected, atol=ATOL)
                    outcomes.append("ok" if ok else "wrong")
                except triton.InferenceServerException as err:
                    outcomes.append(f"{err.status()}: {err.message()}")

        threads = [threading.Thread(target=one) for _ in range(10)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        exhausted = [o for o in outcomes if o.startswith("StatusCode.RESOURCE_EXHAUSTED")]
        assert exhausted and all("queue full" in o for o in exhausted), outcomes
        assert set(outcomes) - set(exhausted) == {"ok"}, outcomes
        with triton.InferenceServerClient(server.grpc_url) as client:
            assert client.get_model_config(MODEL).config.WhichOneof("scheduling_choice") is None
            stats = client.get_inference_statistics(MODEL).model_stats[0]
            assert stats.execution_count == stats.inference_count  # every request ran alone
            assert {b.batch_size for b in stats.batch_stats} == {1}
    finally:
        server.stop()
    assert server.process.returncode == 0


def test_unexpected_errors_are_internal_without_a_traceback_and_serving_goes_on(minilm_artifact: Path, minilm_engine):
    script = Path(__file__).parent / "clients" / "faulty_server.py"
    fault = 4242
    server = ServerProcess(minilm_artifact, command=[sys.executable, str(script), str(minilm_artifact), str(fault)])
    try:
        with triton.InferenceServerClient(server.grpc_url) as client:
            with pytest.raises(triton.InferenceServerException) as raised:
                client.infer(MODEL, [_input(np.array([[101, fault, 102]]))])
            assert raised.value.status() == "StatusCode.INTERNAL"
            assert "internal error (reference" in raised.value.message()
            assert "secret" not in raised.value.message() and "Traceback" not in raised.value.message()
            # HTTP maps the same error the same way: 500 with a log reference.
            over_http = requests.post(f"http://{server.http_url}/v1/embeddings", timeout=30,
                                      json={"model": MODEL, "input": [101, fault, 102]})
            assert over_http.status_code == 500
            http_error = over_http.json()["error"]
            assert http_error["type"] == "server_error" and "internal error (reference" in http_error["message"]
            assert "secret" not in over_http.text and "Traceback" not in over_http.text
            assert requests.post(f"http://{server.http_url}/v1/embeddings", timeout=30,
                                 json={"model": MODEL, "input": [101, 2000, 102]}).status_code == 200
            for length in (3, 9, 27):  # every batch's metrics recording fails; the answers still go out
                ids = np.full((1, length), 2000)
                good = client.infer(MODEL, [_input(ids)]).as_numpy("sentence_embedding")
                np.testing.assert_allclose(good, minilm_engine.run(ids).sentence_embedding, atol=ATOL)
            assert client.is_server_ready()
        with grpc.insecure_channel(server.grpc_url) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop()
    reference = raised.value.message().split("reference ")[1].split(" ")[0]
    assert f"reference {reference}" in server.log() and "injected fault: secret" in server.log()
    assert "recording a batch failed; serving continues" in server.log()
    # On stopping, the server says how each wire's inference requests were answered.
    assert "HTTP inference requests answered: 200 1, 500 1\n" in server.log()
    assert ANSWERED.search(server.log()).group(1) == "INTERNAL 1, OK 3"
    http_reference = http_error["message"].split("reference ")[1].split(" ")[0]
    assert f"reference {http_reference}" in server.log()
