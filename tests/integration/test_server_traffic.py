"""The traffic record of a real server: executed shapes are counted, written atomically while
serving and at exit, published as a metric, read back after a restart; an unreadable file is
set aside and does not stop the server."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton

from dietserve.runtime.manifest import LAYOUT_PACKED, Manifest
from dietserve.runtime.traffic import Traffic

from .scrape import metrics, total, wait_for
from .server_process import ServerProcess

pytestmark = pytest.mark.slow
MODEL = "traffic"


def _infer(server: ServerProcess, ids: np.ndarray) -> None:
    tensor = triton.InferInput("input_ids", list(ids.shape), "INT64")
    tensor.set_data_from_numpy(ids)
    with triton.InferenceServerClient(server.grpc_url) as client:
        client.infer(MODEL, [tensor], outputs=[triton.InferRequestedOutput("sentence_embedding")])


def _rows_up_to(server: ServerProcess, length: int) -> float:
    return total(metrics(server), "dietserve_traffic_rows", le=str(length))


def test_traffic_is_recorded_saved_and_survives_a_restart(minilm_artifact: Path, tmp_path: Path):
    path = tmp_path / "traffic.json"
    path.write_text("{ half a file")  # as a crash of an older, non-atomic writer would leave it
    flags = ("--no-batching", "--traffic-file", str(path), "--traffic-save-seconds", "0.3",
             "--traffic-half-life-seconds", "1e7")  # no visible decay during the test
    server = ServerProcess(minilm_artifact, *flags, model_name=MODEL)
    try:
        assert "starting from an empty traffic record" in server.log()
        assert total(metrics(server), "dietserve_traffic_file_resets_total") == 1
        for _ in range(3):
            _infer(server, np.full((1, 37), 2000))
        _infer(server, np.full((2, 100), 2000))
        wait_for(lambda: _rows_up_to(server, 128) >= 4.99, "5 recorded rows", timeout=30, interval=0.1)
        assert _rows_up_to(server, 64) == pytest.approx(3, rel=1e-3)
        assert _rows_up_to(server, 128) == pytest.approx(5, rel=1e-3)
        saved = Traffic.load(path)  # written while serving
        assert Manifest.read(minilm_artifact).layout == LAYOUT_PACKED  # each row at its own length
        assert saved.weights[(1, 37)] == pytest.approx(3, rel=1e-3)
        assert saved.weights[(1, 100)] == pytest.approx(2, rel=1e-3)
        assert saved.token_weights == pytest.approx({37: 3, 200: 1}, rel=1e-3)  # the executions' tokens
    finally:
        server.stop()
    aside = list(tmp_path.glob("traffic.json.unreadable-*"))
    assert len(aside) == 1 and aside[0].read_text() == "{ half a file"
    restarted = ServerProcess(minilm_artifact, *flags, model_name=MODEL)
    try:
        time.sleep(1.0)
        assert _rows_up_to(restarted, 128) == pytest.approx(5, rel=1e-3)  # warm-up runs are not traffic
        assert total(metrics(restarted), "dietserve_traffic_file_resets_total") == 0
    finally:
        restarted.stop()
