"""Replicas sharing one version store (a volume several servers mount), each tuning its host by
itself (``--auto-tune``): started together on an empty store, one compiles and publishes the
untuned version while the other waits and serves it, one re-tuning job runs while the other
server's waits, and both swap in the version it publishes, answering as sentence-transformers'
CrossEncoder throughout. The small generated reranker is the model: its tune takes seconds."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from dietserve.runtime.versions import VersionStore

from .scrape import metrics, total
from .server_process import ServerProcess
from .test_rerank import DOCUMENTS, QUERY, cross_encoder_scores
from .test_several_models import RERANKER, SCORE_ATOL, _rerank_scores

pytestmark = pytest.mark.slow
STARTED_JOB = "re-tuning (no tuned version for this host): pid"


def test_replicas_on_one_store_publish_once_tune_once_and_both_swap(tmp_path: Path, cache_dir: Path,
                                                                     reranker_artifact):
    folder, _ = reranker_artifact
    store = VersionStore(tmp_path / "store")
    flags = ("--artifact-store", str(store.root), "--model", str(folder), "--max-batch", "8",
             "--cache-dir", str(cache_dir), "--watch-seconds", "0.5", "--swap-min-gain", "0",
             "--retune-trials", "2", "--retune-check-seconds", "1", "--retune-db", str(tmp_path / "records.jsonl"))
    with ThreadPoolExecutor(2) as pool:
        replicas = list(pool.map(lambda _: ServerProcess(None, *flags, model_name=None), range(2)))
    expected = cross_encoder_scores(folder, [(QUERY, document) for document in DOCUMENTS])
    try:
        deadline = time.monotonic() + 600
        while min(total(metrics(server), "dietserve_swaps_total", model=RERANKER) for server in replicas) < 1:
            for server in replicas:
                np.testing.assert_allclose(_rerank_scores(server), expected, rtol=0, atol=SCORE_ATOL)
                assert server.process.poll() is None, server.log()[-3000:]
            assert time.monotonic() < deadline, "\n\n".join(server.log()[-2000:] for server in replicas)
            time.sleep(0.5)
        for server in replicas:
            np.testing.assert_allclose(_rerank_scores(server), expected, rtol=0, atol=SCORE_ATOL)
    finally:
        for server in replicas:
            server.stop()
    logs = [server.log() for server in replicas]
    assert store.versions() == [1, 2] and store.current() == 2 and store.tuned(2), logs
    assert sum("published the untuned artifact as version 1" in log for log in logs) == 1, logs
    assert sum(log.count(STARTED_JOB) for log in logs) == 1, logs
    assert any("waits: another server's job on" in log for log in logs), logs
