"""API keys (``--api-key-file``) against a real server process: refused without the right key on
both wires (HTTP 401 with a Bearer challenge, gRPC UNAUTHENTICATED), served with it by real
clients (requests, OpenAI's, tritonclient), health, readiness and /metrics open, and no key in
the server's log."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest
import requests
import tritonclient.grpc as triton_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .scrape import metrics
from .server_process import REPO_ROOT, ServerProcess

pytestmark = pytest.mark.slow
MODEL, TEXT_MODEL = "minilm", "minilm-text"
KEY, SECOND_KEY, WRONG_KEY = "sk-dietserve-test-0a1b2c3d4e5f", "sk-dietserve-second-99887766", "sk-dietserve-wrong-1234"


@pytest.fixture(scope="module")
def server(minilm_artifact: Path, tmp_path_factory: pytest.TempPathFactory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"# the test's keys\n{KEY}\n\n{SECOND_KEY}\n")
    process = ServerProcess(minilm_artifact, "--api-key-file", str(keys), model_name=MODEL)
    yield process
    process.stop()


def _refused(server: ServerProcess, wire: str) -> float:
    return metrics(server).get(("dietserve_unauthenticated_requests_total", (("wire", wire),)), 0.0)


def _text_input(text: str) -> triton_grpc.InferInput:
    tensor = triton_grpc.InferInput("text", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([text.encode()], dtype=object))
    return tensor


def test_http_without_the_right_key_gets_401_with_a_bearer_challenge(server):
    base, before = f"http://{server.http_url}", _refused(server, "http")
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}
    for headers, message in (({}, "needs an API key"), ({"Authorization": f"Bearer {WRONG_KEY}"}, "invalid API key"),
                             ({"Authorization": KEY}, "must read 'Bearer KEY'")):
        answer = requests.post(f"{base}/v2/models/{TEXT_MODEL}/infer", json=body, headers=headers, timeout=30)
        assert answer.status_code == 401 and answer.headers["WWW-Authenticate"] == "Bearer"
        assert message in answer.json()["error"]
    openai_shaped = requests.post(f"{base}/v1/embeddings", json={"model": MODEL, "input": "hi"}, timeout=30)
    assert openai_shaped.status_code == 401 and openai_shaped.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(f"{base}/v2/models/{MODEL}", timeout=30).status_code == 401
    assert _refused(server, "http") == before + 5


def test_http_with_a_key_is_served_to_requests_and_openai(server):
    base = f"http://{server.http_url}"
    for key in (KEY, SECOND_KEY):
        answer = requests.post(f"{base}/v2/models/{TEXT_MODEL}/infer", headers={"Authorization": f"Bearer {key}"},
                               json={"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]},
                               timeout=30)
        assert answer.status_code == 200, answer.text
    with openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0) as client:
        embedded = client.embeddings.create(model=MODEL, input=["A man is eating food."], encoding_format="float")
        assert len(embedded.data[0].embedding) == 384
    with openai.OpenAI(base_url=f"{base}/v1", api_key=WRONG_KEY, max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError) as raised:
            client.embeddings.create(model=MODEL, input="hi")
    assert raised.value.body["code"] == "invalid_api_key"


def test_grpc_needs_the_key_in_authorization_metadata(server):
    before = _refused(server, "grpc")
    with triton_grpc.InferenceServerClient(server.grpc_url) as client:
        for headers in (None, {"authorization": f"Bearer {WRONG_KEY}"}):
            with pytest.raises(triton_grpc.InferenceServerException) as raised:
                client.infer(TEXT_MODEL, [_text_input("hi")], headers=headers)
            assert raised.value.status() == str(grpc.StatusCode.UNAUTHENTICATED)
            assert WRONG_KEY not in raised.value.message()
        with pytest.raises(triton_grpc.InferenceServerException, match="needs an API key"):
            client.get_model_metadata(MODEL)
        answer = client.infer(TEXT_MODEL, [_text_input("hi")], headers={"authorization": f"Bearer {KEY}"})
        assert answer.as_numpy("sentence_embedding").shape == (1, 384)
        assert client.get_model_metadata(MODEL, headers={"authorization": f"Bearer {SECOND_KEY}"}).name == MODEL
        # Liveness and readiness answer without a key.
        assert client.is_server_live() and client.is_server_ready()
    assert _refused(server, "grpc") == before + 3


def test_teis_grpc_services_need_the_key_too(server):
    from dietserve.server._proto import tei_pb2 as tei
    from dietserve.server._proto import tei_pb2_grpc as tei_grpc

    before = _refused(server, "grpc")
    with grpc.insecure_channel(server.grpc_url) as channel:
        embed = tei_grpc.EmbedStub(channel)
        for call in (lambda: embed.Embed(tei.EmbedRequest(inputs="hi")),
                     lambda: list(embed.EmbedStream(iter([tei.EmbedRequest(inputs="hi")]))),
                     lambda: tei_grpc.InfoStub(channel).Info(tei.InfoRequest())):
            with pytest.raises(grpc.RpcError) as raised:
                call()
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
        keyed = (("authorization", f"Bearer {KEY}"),)
        assert len(embed.Embed(tei.EmbedRequest(inputs="hi"), metadata=keyed).embeddings) == 384
    assert _refused(server, "grpc") == before + 3


def test_health_readiness_and_metrics_need_no_key(server):
    base = f"http://{server.http_url}"
    for path in ("/health", "/v2/health/live", "/v2/health/ready"):
        assert requests.get(f"{base}{path}", timeout=10).status_code == 200, path
    with grpc.insecure_channel(server.grpc_url) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
    assert ("dietserve_ready", ()) in metrics(server)


def test_no_key_appears_in_the_server_log(server):
    requests.post(f"http://{server.http_url}/v1/embeddings", headers={"Authorization": f"Bearer {WRONG_KEY}"},
                  json={"model": MODEL, "input": "hi"}, timeout=30)
    log = server.log()
    assert "ready: model" in log  # the log was captured
    for key in (KEY, SECOND_KEY, WRONG_KEY):
        assert key not in log


def test_a_key_file_without_keys_stops_the_server_at_start(minilm_artifact: Path, tmp_path: Path):
    empty = tmp_path / "keys"
    empty.write_text("# no keys yet\n\n")
    completed = subprocess.run([sys.executable, "-m", "dietserve", "serve", "--artifact", str(minilm_artifact),
                                "--port", "0", "--metrics-port", "0", "--http-port", "0", "--api-key-file", str(empty)],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 2
    assert f"--api-key-file {empty} holds no API key" in completed.stderr
