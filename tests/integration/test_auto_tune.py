"""``serve`` tunes its host by itself (``--auto-tune``, the default on a CPU), with a tiny budget:
two replicas started together on one empty store (a volume several servers mount) serve the
cold-start kernels (planned from the hardware model) at once, one publishing them while the other
waits; one tunes in the background while the other's job waits; both check and swap in the
version it publishes while requests flow, every answer right (to 1e-4, as the untuned engine
answers); a restart serves the tuned
version and tunes nothing; a version built for another CPU is not served. The small generated
reranker is the model: its tunes take seconds."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dietserve.commands.auto_tune import unfit_for_host
from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.engine import Engine
from dietserve.runtime.manifest import MANIFEST_FILE, PLANS_ANALYTIC, Manifest
from dietserve.runtime.versions import VersionStore

from .conftest import MAX_BATCH
from .scrape import metrics, total
from .server_process import ServerProcess
from .test_hot_swap import SteadyClient

pytestmark = pytest.mark.slow
MODEL = "auto"


def _flags(store: Path, records: Path, cache_dir: Path, model: Path) -> tuple[str, ...]:
    return ("--artifact-store", str(store), "--watch-seconds", "0.5", "--swap-min-gain", "0",
            "--retune-trials", "2", "--retune-check-seconds", "1", "--retune-db", str(records),
            "--model", str(model), "--max-batch", str(MAX_BATCH), "--cache-dir", str(cache_dir))


def _job_log(store: Path) -> str:
    return "\n".join(path.read_text()[-3000:] for path in sorted((store / "retune").glob("job-*.log")))


def test_replicas_tune_their_host_once_and_a_restart_serves_the_tuned_version(
        tmp_path: Path, cache_dir: Path, reranker_artifact) -> None:
    store_dir, records = tmp_path / "store", tmp_path / "records.jsonl"
    store = VersionStore(store_dir)
    flags = _flags(store_dir, records, cache_dir, reranker_artifact[0])
    engine = Engine(load_artifact(reranker_artifact[1]))
    # Two replicas sharing the store, started together (a volume several servers mount).
    with ThreadPoolExecutor(2) as pool:
        replicas = list(pool.map(lambda _: ServerProcess(None, *flags, model_name=MODEL), range(2)))
    clients = [SteadyClient(server, engine, MODEL, "logits") for server in replicas]
    try:
        # the cold start, served at once: planned from the hardware model, so not tuned
        assert store.versions() == [1] and not store.tuned(1)
        assert Manifest.read(store.path(1)).kernel_plans == PLANS_ANALYTIC
        deadline = time.monotonic() + 1200
        while min(total(metrics(server), "dietserve_swaps_total") for server in replicas) < 1:
            assert time.monotonic() < deadline, "no swap:\n" + "\n\n".join(s.log()[-2000:] for s in replicas)
            for server in replicas:
                assert server.process.poll() is None and store.rejected(2) is None, server.log()[-3000:]
                assert "failed (exit" not in server.log(), _job_log(store_dir)
            time.sleep(1)
        time.sleep(2)  # requests on the tuned version
    finally:
        for client in clients:
            client.stop()
        for server in replicas:
            server.stop()
    logs = [server.log() for server in replicas]
    for client in clients:
        assert client.failures == [] and client.answers > 10, client.failures[:5]
    assert store.versions() == [1, 2] and store.current() == 2 and store.tuned(2), logs
    # One published the cold-start version while the other waited for it; one job ran while the
    # other server's waited, and both swapped in what it published.
    assert sum("published the cold-start artifact as version 1" in log for log in logs) == 1, logs
    assert sum(log.count("re-tuning (no tuned version for this host): pid") for log in logs) == 1, logs
    assert any("waits: another server's job on" in log for log in logs), logs
    assert all("published (exit 0)" in log or "checked against the served version and swapped in" in log
               for log in logs), logs

    restarted = ServerProcess(None, *flags, model_name=MODEL)
    try:
        time.sleep(3)  # the policy checks at once: a job would have started
        again = SteadyClient(restarted, engine, MODEL, "logits")
        time.sleep(2)
        again.stop()
    finally:
        restarted.stop()
    assert again.failures == [] and again.answers > 0
    assert "tuned for this host" in restarted.log() and "re-tuning (" not in restarted.log()

    # The tuned version as if built on another CPU: not served; the cold-start one fits and is tuned.
    manifest = json.loads((store.path(2) / MANIFEST_FILE).read_text())
    manifest["target"]["mcpu"] = "skylake-avx512"
    (store.path(2) / MANIFEST_FILE).write_text(json.dumps(manifest))
    third = ServerProcess(None, *flags, "--retune-time-budget", "1", model_name=MODEL)
    third.stop()
    assert "version 2 of" in third.log() and "does not fit this host: built for mcpu skylake-avx512" in third.log()
    assert "serving version 1 of" in third.log() and "no tuned version for this host" in third.log()


def test_a_version_fits_only_its_cpu_core_count_and_tvm(minilm_artifact: Path) -> None:
    manifest = Manifest.read(minilm_artifact)
    here, version = dict(manifest.target), manifest.tvm_version
    assert unfit_for_host(manifest, here, version) is None
    assert "mcpu" in unfit_for_host(manifest, {**here, "mcpu": "icelake-server"}, version)
    assert "num-cores" in unfit_for_host(manifest, {**here, "num-cores": "64"}, version)
    assert "TVM" in unfit_for_host(manifest, here, "0.26.0")
