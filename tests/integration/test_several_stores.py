"""Two version stores in one server, an embedder's (found in --model-repository) and a reranker's
(--artifact-store), each hot-swapped and re-tuned on its own while a client keeps asking the
embedder: a wrong embedder version is refused without touching the reranker; reranking traffic
that drifts from what the reranker was tuned for runs a re-tuning job for the reranker alone,
which builds the reranker from its manifest (the server's build flags name another model), and
its version is swapped in under the reranker only. Every answer meanwhile is right, and the
metrics say which model each swap, refusal and job belongs to. Last, the same job asked for a
gain its plans do not predict publishes nothing."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dietserve.compile.artifact import CompileRequest
from dietserve.runtime.manifest import Manifest
from dietserve.runtime.traffic import Traffic
from dietserve.runtime.versions import VersionStore

from .scrape import metrics, total, wait_for
from .server_process import REPO_ROOT, ServerProcess
from .test_hot_swap import SteadyClient, tampered_copy
from .test_rerank import DOCUMENTS, QUERY, cross_encoder_scores
from .test_several_models import EMBEDDER, RERANKER, SCORE_ATOL, _rerank_scores

pytestmark = pytest.mark.slow
MIN_ROWS = 30  # the embedder's client has gone round its 12 cases twice by then: its mix is the one tuned for


def _traffic(path: Path, lengths) -> Path:
    traffic = Traffic(half_life_seconds=3600.0, as_of=0.0)
    for length in lengths:
        traffic.record(1, int(length), now=0.0)
    traffic.save(path)
    return path


def test_each_store_is_swapped_and_retuned_on_its_own(tmp_path: Path, cache_dir: Path, minilm_artifact: Path,
                                                      minilm_engine, reranker_artifact):
    folder, reranker = reranker_artifact
    build = Manifest.read(reranker).build  # what the re-tuning job builds from
    assert CompileRequest.from_build_record(build) == CompileRequest(model=str(folder.resolve()), max_batch=8)

    embedder_store = VersionStore(tmp_path / "repository" / "embedder")
    rng = np.random.default_rng(11)  # SteadyClient's cases: the embedder is tuned for their mix, so never drifts
    embedder_store.publish(minilm_artifact, tuned_for=_traffic(tmp_path / "steady.json",
                                                               rng.integers(4, 120, size=12)))
    reranker_store = VersionStore(tmp_path / "reranker-store")
    reranker_store.publish(reranker, tuned_for=_traffic(tmp_path / "short.json", (1, 2, 3, 4)))
    server = ServerProcess(
        None, "--model-repository", str(tmp_path / "repository"), "--artifact-store", str(reranker_store.root),
        "--watch-seconds", "0.3", "--swap-min-gain", "0", "--no-auto-tune",
        "--retune", "--retune-min-rows", str(MIN_ROWS), "--retune-drift", "0.5", "--retune-min-interval", "0",
        "--retune-check-seconds", "1", "--retune-trials", "2", "--retune-min-gain", "0",
        "--model", "default", "--cache-dir", str(cache_dir), model_name=None)
    expected_scores = cross_encoder_scores(folder, [(QUERY, document) for document in DOCUMENTS])
    client = SteadyClient(server, minilm_engine, model=EMBEDDER)
    try:
        # A wrong embedder version: refused under the embedder; the reranker is not touched.
        embedder_store.publish(tampered_copy(minilm_artifact, tmp_path / "tampered"))
        wait_for(lambda: total(metrics(server), "dietserve_swap_failures_total", model=EMBEDDER) == 1,
                 "the embedder's refusal", timeout=120)
        assert embedder_store.rejected(2) and embedder_store.current() == 1

        # Reranking traffic, longer than the reranker was tuned for: its job, its version.
        deadline = time.monotonic() + 600
        while reranker_store.current() != 2:
            np.testing.assert_allclose(_rerank_scores(server), expected_scores, rtol=0, atol=SCORE_ATOL)
            assert time.monotonic() < deadline, "no reranker swap:\n" + server.log()[-3000:]
            assert server.process.poll() is None, server.log()
            time.sleep(0.2)
        np.testing.assert_allclose(_rerank_scores(server), expected_scores, rtol=0, atol=SCORE_ATOL)
        # The swap can come before the policy's next check has seen the job end.
        wait_for(lambda: total(metrics(server), "dietserve_retune_runs_total", model=RERANKER) >= 1,
                 "the reranker job's outcome", timeout=30)
        samples = metrics(server)
    finally:
        client.stop()
        server.stop()
    log = server.log()
    assert client.failures == [] and client.answers > 20, client.failures[:5]
    assert Manifest.read(reranker_store.path(2)).model_name == RERANKER and reranker_store.rejected(2) is None
    assert f"{RERANKER}: re-tuning (drift" in log and f"{EMBEDDER}: re-tuning" not in log, log[-3000:]
    assert f"{RERANKER}: version 2: checked against the served version and swapped in" in log
    assert total(samples, "dietserve_retune_runs_total", model=RERANKER, outcome="published") == 1
    assert total(samples, "dietserve_retune_runs_total", model=EMBEDDER) == 0
    assert total(samples, "dietserve_swaps_total", model=RERANKER) == 1
    assert total(samples, "dietserve_swaps_total", model=EMBEDDER) == 0
    assert total(samples, "dietserve_swap_failures_total", model=RERANKER) == 0
    assert total(samples, "dietserve_artifact_version_info", model=RERANKER, version="2") == 1
    assert total(samples, "dietserve_artifact_version_info", model=EMBEDDER, version="1") == 1
    assert total(samples, "dietserve_batch_size_count", model=EMBEDDER) > 20
    assert total(samples, "dietserve_traffic_drift", model=EMBEDDER) < 0.5

    # The job asked for a gain no plan predicts: it tunes (from the records), compiles, publishes nothing.
    snapshot = sorted((reranker_store.root / "retune").glob("traffic-*.json"))[-1]
    refused = subprocess.run([sys.executable, "-m", "dietserve", "retune", "--store", str(reranker_store.root),
                              "--traffic", str(snapshot), "--trials", "1", "--min-gain", "1000",
                              "--cache-dir", str(cache_dir)], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=600)
    assert refused.returncode == 3, refused.stderr[-3000:]
    assert "not published: predicted gain" in refused.stdout and reranker_store.versions() == [1, 2]
