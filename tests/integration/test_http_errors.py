"""Malformed HTTP and over-long text against a real server process: each bad request gets a 4xx
whose body names the problem, the server keeps serving, and truncation is the request's choice
over the server's default (refuse)."""

from __future__ import annotations

import socket
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as triton_grpc

from dietserve.runtime.embedder import artifact_tokenizer

from .server_process import ServerProcess
from .test_sentence_embedding import sentence_transformers_length

pytestmark = pytest.mark.slow
MODEL = "minilm"
TEXT_MODEL = "minilm-text"
LIMIT = 1 << 20
LONG_TEXT = "word " * 600  # 600 tokens + [CLS] and [SEP], over MiniLM's 512 positions and its 256-token text bound
SAME = 1e-6


@pytest.fixture(scope="module")
def server(minilm_artifact: Path):
    process = ServerProcess(minilm_artifact, "--max-request-bytes", str(LIMIT), "--http-body-timeout-seconds", "1",
                            model_name=MODEL)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def grpc_client(server: ServerProcess):
    with triton_grpc.InferenceServerClient(server.grpc_url) as client:
        yield client


def _v2_text(text: str) -> dict:
    return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [text]}]}


def _ids(count: int = 3) -> dict:
    return {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, count], "data": [101] * count}]}


INFER = f"/v2/models/{MODEL}/infer"
BINARY_HEADER = (b'{"inputs":[{"name":"input_ids","datatype":"INT64","shape":[1,2],'
                 b'"parameters":{"binary_data_size":16}}]}')
EMBED = "/v1/embeddings"
# name -> (method, path, body (bytes: sent as is; else as JSON), headers, status, words the error names)
BAD_REQUESTS = {
    "not json": ("POST", INFER, b"{inputs", {}, 400, "not valid JSON"),
    "json not an object": ("POST", INFER, [1, 2], {}, 400, "must be a JSON object, got list"),
    "inputs missing": ("POST", INFER, {"outputs": []}, {}, 400, "needs 'inputs'"),
    "shape of strings": ("POST", INFER, {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": ["1"],
                                                     "data": [1]}]}, {}, 400, "shape must be a list of integers"),
    "floats for INT64": ("POST", INFER, {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 2],
                                                     "data": [1.5, 2]}]}, {}, 400, "must hold integers, got 1.5"),
    "ragged data": ("POST", INFER, {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [2, 2],
                                                "data": [[1, 2], [3]]}]}, {}, 400, "ragged"),
    "text as numbers": ("POST", f"/v2/models/{TEXT_MODEL}/infer", {"inputs": [
        {"name": "text", "datatype": "BYTES", "shape": [1], "data": [7]}]}, {}, 400, "must hold strings, got int"),
    "data size against shape": ("POST", INFER, {"inputs": [{"name": "input_ids", "datatype": "INT64",
                                                            "shape": [1, 4], "data": [1, 2]}]}, {}, 400,
                                "holds 2 INT64 values but its shape [1, 4] needs 4"),
    "binary size past the body": ("POST", INFER, BINARY_HEADER + b"\0" * 8,
                                  {"Inference-Header-Content-Length": str(len(BINARY_HEADER))}, 400,
                                  "declares 16 bytes of binary data, but 8 follow"),
    "header length not a number": ("POST", INFER, b"{}", {"Inference-Header-Content-Length": "ten"}, 400,
                                   "must be a number of bytes, got 'ten'"),
    "header length past the body": ("POST", INFER, b"{}", {"Inference-Header-Content-Length": "99"}, 400,
                                    "is 99, but the body has 2 bytes"),
    "unclaimed binary data": ("POST", INFER, b'{"inputs":[]}' + b"xx", {"Inference-Header-Content-Length": "13"},
                              400, "2 bytes of binary data follow the JSON header that no input claims"),
    "body over the limit": ("POST", INFER, b"x" * (LIMIT + 1), {}, 413, f"over this server's limit of {LIMIT}"),
    "unknown model": ("POST", "/v2/models/gpt-7/infer", _ids(), {}, 404, "unknown model 'gpt-7'"),
    "unknown version": ("GET", f"/v2/models/{MODEL}/versions/9", None, {}, 404, "has no version '9'"),
    "unknown route": ("GET", "/v3/models", None, {}, 404, "no route GET /v3/models"),
    "wrong method": ("GET", INFER, None, {}, 405, "GET is not allowed on"),
    "openai bad encoding": ("POST", EMBED, {"model": MODEL, "input": "hi", "encoding_format": "base85"}, {}, 400,
                            "encoding_format must be 'float' or 'base64'"),
    "openai no input": ("POST", EMBED, {"model": MODEL}, {}, 400, "needs 'input'"),
    "openai model not a name": ("POST", EMBED, {"model": 7, "input": "hi"}, {}, 400,
                                "model must name a served model: minilm"),
    "openai empty input": ("POST", EMBED, {"model": MODEL, "input": []}, {}, 400, "not empty"),
    "openai token out of vocabulary": ("POST", EMBED, {"model": MODEL, "input": [101, 10 ** 6]}, {}, 400,
                                       "token id 1000000"),
    "openai truncate not a bool": ("POST", EMBED, {"model": MODEL, "input": "hi", "truncate": "yes"}, {}, 400,
                                   "parameter 'truncate' must be a bool"),
    "openai lone surrogate": ("POST", EMBED, b'{"model": "minilm", "input": "\\ud800"}', {}, 400, "not UTF-8"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_http_request_gets_a_named_4xx_and_the_server_keeps_serving(case, server):
    method, path, body, headers, status, words = BAD_REQUESTS[case]
    sent = {"data": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    answer = requests.request(method, f"http://{server.http_url}{path}", headers=headers, timeout=30, **sent)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    message = error["message"] if path.startswith("/v1/") else error
    assert words in message and "Traceback" not in message
    good = requests.post(f"http://{server.http_url}{INFER}", json=_ids(), timeout=30)
    assert good.status_code == 200 and good.json()["outputs"][1]["shape"] == [1, 384]


def _raw_exchange(server: ServerProcess, data: bytes) -> bytes:
    """Sends ``data`` on a raw connection (never half-closed: that drops the answer) and reads
    one response."""
    host, port = server.http_url.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(data)
        received = b""
        while b"\r\n\r\n" not in received or len(received.split(b"\r\n\r\n", 1)[1]) < _length(received):
            chunk = connection.recv(65536)
            if not chunk:
                break
            received += chunk
    return received


def _length(received: bytes) -> int:
    for line in received.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def test_a_lying_content_length_is_refused_naming_it(server):
    body = b'{"inputs": []}'
    longer = b"POST /v2/models/minilm/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (len(body) + 100)
    answer = _raw_exchange(server, longer + body)  # the rest never comes: refused after the body timeout
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"did not arrive within 1 s: 14 bytes of the 114 its Content-Length declares came" in answer
    shorter = b"POST /v2/models/minilm/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n"
    answer = _raw_exchange(server, shorter + body)  # what follows the declared length is no request
    assert answer.startswith(b"HTTP/1.0 400") and b'Invalid method encountered:\n\n  b\'{"inputs"' in answer, answer
    assert requests.post(f"http://{server.http_url}{INFER}", json=_ids(), timeout=30).status_code == 200


# ---------------------------------------------------------------------------- truncation


def test_too_long_text_is_refused_on_every_wire_naming_the_counts(server, grpc_client):
    with pytest.raises(triton_grpc.InferenceServerException) as raised:
        _grpc_text(grpc_client, LONG_TEXT)
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    expected = f"text 0 has 602 tokens, over the model's maximum of {sentence_transformers_length()}"
    assert expected in raised.value.message()
    v2 = requests.post(f"http://{server.http_url}/v2/models/{TEXT_MODEL}/infer", json=_v2_text(LONG_TEXT), timeout=30)
    assert v2.status_code == 413 and expected in v2.json()["error"]
    embed = requests.post(f"http://{server.http_url}{EMBED}", timeout=30,
                          json={"model": MODEL, "input": ["short", LONG_TEXT]})
    assert embed.status_code == 413 and "text 1 has 602 tokens" in embed.json()["error"]["message"]
    assert embed.json()["error"]["code"] == "context_length_exceeded"
    ids = requests.post(f"http://{server.http_url}{EMBED}", json={"model": MODEL, "input": [[101] * 600]}, timeout=30)
    assert ids.status_code == 413 and "input[0] has 600 tokens" in ids.json()["error"]["message"]


def test_a_text_over_the_byte_bound_is_too_long_without_truncation(server, grpc_client, minilm_engine):
    tokenizer = artifact_tokenizer(minilm_engine)
    huge = "a" * (tokenizer.byte_limit + 10)  # one word: a single [UNK] in the part read, yet never counted whole
    with pytest.raises(triton_grpc.InferenceServerException) as raised:
        _grpc_text(grpc_client, huge)
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert f"longer than the {tokenizer.byte_limit} bytes" in raised.value.message()
    assert _grpc_text(grpc_client, huge, truncate=True).shape == (1, 384)


def test_truncate_true_embeds_the_first_tokens_on_every_wire(server, grpc_client, minilm_engine):
    truncated = _grpc_text(grpc_client, LONG_TEXT, truncate=True)
    encoded = artifact_tokenizer(minilm_engine).encode([LONG_TEXT], truncate=True)
    assert encoded.input_ids.shape == (1, sentence_transformers_length())
    np.testing.assert_allclose(truncated, minilm_engine.run(encoded.input_ids).sentence_embedding, atol=1e-4)
    body = _v2_text(LONG_TEXT) | {"parameters": {"truncate": True}, "outputs": [{"name": "sentence_embedding"}]}
    v2 = requests.post(f"http://{server.http_url}/v2/models/{TEXT_MODEL}/infer", json=body, timeout=30)
    np.testing.assert_allclose(np.reshape(v2.json()["outputs"][0]["data"], (1, 384)), truncated, atol=SAME)
    embed = requests.post(f"http://{server.http_url}{EMBED}", timeout=30,
                          json={"model": MODEL, "input": LONG_TEXT, "truncate": True}).json()
    np.testing.assert_allclose([embed["data"][0]["embedding"]], truncated, atol=SAME)
    assert embed["usage"]["prompt_tokens"] == sentence_transformers_length()  # special tokens included


def test_the_server_default_flag_flips_truncation(minilm_artifact):
    process = ServerProcess(minilm_artifact, "--truncate", model_name=MODEL)
    try:
        with triton_grpc.InferenceServerClient(process.grpc_url) as client:
            assert _grpc_text(client, LONG_TEXT).shape == (1, 384)
            with pytest.raises(triton_grpc.InferenceServerException, match="602 tokens"):
                _grpc_text(client, LONG_TEXT, truncate=False)
        embed = requests.post(f"http://{process.http_url}{EMBED}", json={"model": MODEL, "input": LONG_TEXT},
                              timeout=30)
        assert embed.status_code == 200 and embed.json()["usage"]["prompt_tokens"] == sentence_transformers_length()
    finally:
        process.stop()


def test_truncate_must_be_a_bool_over_grpc(grpc_client):
    with pytest.raises(triton_grpc.InferenceServerException) as raised:
        _grpc_text(grpc_client, "hi", truncate="yes")
    assert raised.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
    assert "parameter 'truncate' must be a bool" in raised.value.message()


def _grpc_text(client, text: str, **parameters) -> np.ndarray:
    tensor = triton_grpc.InferInput("text", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([text.encode()], dtype=object))
    result = client.infer(TEXT_MODEL, [tensor], outputs=[triton_grpc.InferRequestedOutput("sentence_embedding")],
                          parameters=parameters or None)
    return result.as_numpy("sentence_embedding")
