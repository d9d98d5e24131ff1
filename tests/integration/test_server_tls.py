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


# ---------------------------------------------------------------------------- mutual TLS


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _signed(folder: Path, name: str, ca: tuple[Path, Path], subject: str, extension: str) -> tuple[Path, Path]:
    key, request, cert, ext = (folder / f"{name}.key", folder / f"{name}.csr", folder / f"{name}.crt",
                               folder / f"{name}.ext")
    ext.write_text(extension + "\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subject, "-keyout", str(key), "-out", str(request))
    _openssl("x509", "-req", "-in", str(request), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
             "-days", "1", "-extfile", str(ext), "-out", str(cert))
    return cert, key


def _authority(folder: Path, name: str) -> tuple[Path, Path]:
    cert, key = folder / f"{name}.crt", folder / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}",
             "-keyout", str(key), "-out", str(cert))
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """A CA that signs the server's and a client's certificates, and a stranger CA with its own client."""
    folder = tmp_path_factory.mktemp("pki")
    ca, stranger = _authority(folder, "ca"), _authority(folder, "stranger-ca")
    return {
        "ca": ca,
        "server": _signed(folder, "server", ca, "/CN=localhost", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
        "client": _signed(folder, "client", ca, "/CN=client", "extendedKeyUsage=clientAuth"),
        "stranger": _signed(folder, "stranger", stranger, "/CN=stranger", "extendedKeyUsage=clientAuth"),
    }


@pytest.fixture(scope="module")
def mtls_server(minilm_artifact: Path, pki):
    cert, key = pki["server"]
    process = ServerProcess(minilm_artifact, "--tls-cert", str(cert), "--tls-key", str(key),
                            "--tls-client-ca", str(pki["ca"][0]), model_name=MODEL)
    yield process
    process.stop()


def _mtls_infer(server, pki, client: str | None) -> np.ndarray:
    ids = np.full((1, 9), 2023, np.int64)
    tensor = triton.InferInput("input_ids", [1, 9], "INT64")
    tensor.set_data_from_numpy(ids)
    identity = {} if client is None else {"private_key": str(pki[client][1]), "certificate_chain": str(pki[client][0])}
    with triton.InferenceServerClient(server.grpc_url, ssl=True, root_certificates=str(pki["ca"][0]),
                                      **identity) as c:
        return c.infer(MODEL, [tensor], client_timeout=30).as_numpy("sentence_embedding")


def test_mutual_tls_serves_a_client_with_a_certificate_from_the_ca(mtls_server, pki, minilm_engine) -> None:
    assert "(mutual TLS)" in mtls_server.log()
    embedding = _mtls_infer(mtls_server, pki, "client")
    np.testing.assert_allclose(embedding, minilm_engine.run(np.full((1, 9), 2023)).sentence_embedding, atol=1e-5)


@pytest.mark.parametrize("client", [None, "stranger"])
def test_mutual_tls_refuses_clients_without_a_certificate_from_the_ca(mtls_server, pki, client) -> None:
    with pytest.raises(triton.InferenceServerException) as refused:
        _mtls_infer(mtls_server, pki, client)
    assert refused.value.status() == "StatusCode.UNAVAILABLE"
