"""Faults around online re-tuning, against a real server: the re-tuning job killed mid-run five
times leaves the server serving correct answers and the records readable (the tuner reads them,
skipping at most a torn last line). The small generated reranker is served: its jobs reach their
first record soonest."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton

from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.engine import Engine
from dietserve.runtime.versions import VersionStore

from .scrape import metrics, total
from .server_process import ServerProcess

pytestmark = pytest.mark.slow
MODEL = "faults"
JOB = re.compile(r"re-tuning \(.*\): pid (\d+)")


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _check_answer(server: ServerProcess, engine) -> None:
    ids = np.full((1, 23), 2000, np.int64)
    tensor = triton.InferInput("input_ids", [1, 23], "INT64")
    tensor.set_data_from_numpy(ids)
    with triton.InferenceServerClient(server.grpc_url) as client:
        got = client.infer(MODEL, [tensor], client_timeout=60).as_numpy("logits")
        assert client.is_server_ready()
    np.testing.assert_allclose(got, engine.run(ids).logits, atol=1e-4)


def test_killing_the_retuning_job_five_times_leaves_serving_and_records_intact(
        reranker_artifact, cache_dir: Path, tmp_path: Path):
    from tuner.database.records import RecordDatabase

    store_dir, records = tmp_path / "store", tmp_path / "records.jsonl"
    VersionStore(store_dir).publish(reranker_artifact[1])
    engine = Engine(load_artifact(reranker_artifact[1]))
    server = ServerProcess(None, "--artifact-store", str(store_dir), "--no-auto-tune", "--retune",
                           "--retune-drift", "0",
                           "--retune-min-rows", "1", "--retune-min-interval", "0", "--retune-check-seconds", "0.5",
                           "--retune-trials", "8", "--retune-db", str(records), "--cache-dir", str(cache_dir),
                           model_name=MODEL)
    killed, lines = [], 0
    try:
        _check_answer(server, engine)  # the first recorded rows: drift 0 >= 0 starts a job
        for delay in (0.0, 0.3, 0.7, 1.1, 1.5):
            deadline = time.monotonic() + 240
            while len(JOB.findall(server.log())) <= len(killed):
                assert time.monotonic() < deadline, "no re-tuning job started:\n" + server.log()[-2000:]
                time.sleep(0.2)
            pid = int(JOB.findall(server.log())[len(killed)])
            # Kill while the tuner is writing records: after this job's first new record.
            while _lines(records) <= lines and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(delay)
            os.killpg(pid, signal.SIGKILL)  # the job and the tuner processes it started
            killed.append(pid)
            lines = _lines(records)
            _check_answer(server, engine)
        deadline = time.monotonic() + 60
        while total(metrics(server), "dietserve_retune_runs_total", outcome="failed") < 5:
            assert time.monotonic() < deadline, server.log()[-2000:]
            time.sleep(0.2)
        _check_answer(server, engine)
        assert total(metrics(server), "dietserve_swaps_total") == 0
    finally:
        server.stop()
    assert server.process.returncode == 0
    database = RecordDatabase(records)
    readable = list(database.records())
    assert database.skipped_lines <= len(killed)  # at most the line each kill tore
    assert len(readable) >= len(killed)  # each job was killed after writing a record
