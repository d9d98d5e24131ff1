"""``serve`` tunes its host by itself (``--auto-tune``, the default on a CPU), with a tiny budget:
a first start serves the untuned kernels at once and tunes in the background; the version it
publishes is checked and swapped in while requests flow, every answer right (transformers-exact
to 1e-4, as the untuned engine answers); a restart serves the tuned version and tunes nothing;
a version built for another CPU is not served."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dietserve.commands.auto_tune import unfit_for_host
from dietserve.runtime.manifest import MANIFEST_FILE, Manifest
from dietserve.runtime.versions import PLANS_DIR, VersionStore

from .conftest import MAX_BATCH
from .scrape import metrics, total
from .server_process import ServerProcess
from .test_hot_swap import SteadyClient

pytestmark = pytest.mark.slow
MODEL = "auto"


def _flags(store: Path, records: Path, cache_dir: Path) -> tuple[str, ...]:
    return ("--artifact-store", str(store), "--watch-seconds", "0.5", "--swap-min-gain", "0",
            "--retune-trials", "2", "--retune-check-seconds", "1", "--retune-db", str(records),
            "--model", "default", "--max-batch", str(MAX_BATCH), "--cache-dir", str(cache_dir))


def _job_log(store: Path) -> str:
    return "\n".join(path.read_text()[-3000:] for path in sorted((store / "retune").glob("job-*.log")))


def test_first_start_tunes_in_the_background_and_a_restart_serves_the_tuned_version(
        tmp_path: Path, cache_dir: Path, minilm_artifact: Path, minilm_engine) -> None:
    store_dir, records = tmp_path / "store", tmp_path / "records.jsonl"
    store = VersionStore(store_dir)
    server = ServerProcess(None, *_flags(store_dir, records, cache_dir), model_name=MODEL)
    client = SteadyClient(server, minilm_engine, MODEL)
    try:
        assert store.current() == 1 and not (store.path(1) / PLANS_DIR).exists()  # untuned, served at once
        deadline = time.monotonic() + 1200
        while total(metrics(server), "dietserve_swaps_total") < 1:
            assert time.monotonic() < deadline, "no swap:\n" + server.log()[-3000:]
            assert server.process.poll() is None and store.rejected(2) is None, server.log()[-3000:]
            assert "failed (exit" not in server.log(), _job_log(store_dir)
            time.sleep(2)
        time.sleep(3)  # requests on the tuned version
    finally:
        client.stop()
        server.stop()
    log = server.log()
    assert client.failures == [] and client.answers > 10, client.failures[:5]
    assert "re-tuning (no tuned version for this host)" in log and "published (exit 0)" in log, log[-3000:]
    assert store.current() == 2 and (store.path(2) / PLANS_DIR).is_dir()

    restarted = ServerProcess(None, *_flags(store_dir, records, cache_dir), model_name=MODEL)
    try:
        time.sleep(3)  # the policy checks at once: a job would have started
        again = SteadyClient(restarted, minilm_engine, MODEL)
        time.sleep(2)
        again.stop()
    finally:
        restarted.stop()
    assert again.failures == [] and again.answers > 0
    assert "tuned for this host" in restarted.log() and "re-tuning (" not in restarted.log()

    # The tuned version as if built on another CPU: not served; the untuned one fits and is tuned.
    manifest = json.loads((store.path(2) / MANIFEST_FILE).read_text())
    manifest["target"]["mcpu"] = "skylake-avx512"
    (store.path(2) / MANIFEST_FILE).write_text(json.dumps(manifest))
    third = ServerProcess(None, *_flags(store_dir, records, cache_dir), "--retune-time-budget", "1",
                          model_name=MODEL)
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
