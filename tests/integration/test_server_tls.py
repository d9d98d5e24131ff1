"""gRPC over TLS: a real server with a self-signed certificate; tritonclient with the CA answers
correctly, a plaintext client is refused, and the plaintext health port answers the probes'
question (SERVING) and nothing else."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .server_process import ServerProcess

pytestmark = pytest.mark.slow
MODEL = "minilm-tls"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "tls.crt", folder / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="module")
def tls_server(minilm_artifact: Path, certificate):
    cert, key = certificate
    process = ServerProcess(minilm_artifact, "--tls-cert", str(cert), "--tls-key", str(key), "--health-port", "0",
                            model_name=MODEL)
    yield process
    process.stop()


def test_tls_client_gets_the_engines_answer(tls_server, certificate, minilm_engine) -> None:
    ids = np.full((1, 12), 2023, np.int64)
    tensor = triton.InferInput("input_ids", [1, 12], "INT64")
    tensor.set_data_from_numpy(ids)
    with triton.InferenceServerClient(tls_server.grpc_url, ssl=True,
                                      root_certificates=str(certificate[0])) as client:
        hidden = client.infer(MODEL, [tensor]).as_numpy("last_hidden_state")
    np.testing.assert_allclose(hidden, minilm_engine.run(ids).last_hidden_state, atol=1e-5)


def test_plaintext_client_is_refused_on_the_tls_port(tls_server) -> None:
    with grpc.insecure_channel(tls_server.grpc_url) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.RpcError):
            stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)


def test_health_port_answers_probes_in_plaintext_and_serves_nothing_else(tls_server) -> None:
    assert tls_server.health_url is not None
    with grpc.insecure_channel(tls_server.health_url) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary("/inference.GRPCInferenceService/ServerLive")(b"", timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_tls_needs_both_files(minilm_artifact: Path, certificate) -> None:
    done = subprocess.run([sys.executable, "-m", "dietserve", "serve", "--artifact", str(minilm_artifact),
                           "--tls-cert", str(certificate[0])], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--tls-cert and --tls-key go together" in done.stderr
