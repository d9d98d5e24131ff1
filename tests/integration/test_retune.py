"""Online re-tuning end to end, on this CPU with small budgets: kernels tuned for short sequences
serve traffic that turns long; the server measures the drift, runs the re-tuning job as a
separate process, checks the version it publishes and swaps it in. Every request sent meanwhile
is answered correctly, and the long sequences do not get grossly slower with the swap. The
model is the small generated reranker (its tunes take seconds); the mechanism is the model's
size alike, and ``bench_retune.py`` runs it on MiniLM.

Kernels tuned for 1..4 tokens could be much slower at the longest lengths with padded attention
kernels; with clamped attention kernels and the fused softmax they are about as good as what a
few re-tuning trials find on a small machine that serves meanwhile. The job times its kernels on cores the
server keeps busy, where serial kernels look as fast as parallel ones, so it can publish a
slower version; the server times a new version against the served one before swapping
(``--swap-min-gain``, 0.9 here as by default) and refuses one measured slower. So this test
checks the mechanism: the job runs and publishes, and the server either swaps in a version no
grossly slower or refuses it as measured slower; ``bench_retune.py`` measures the gain with a
real budget. The server here publishes whatever the job finds (``--retune-min-gain 0``); a
job asked for a gain its plans do not predict publishes nothing (``test_several_stores.py``)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton

from dietserve.runtime.artifact import load_artifact
from dietserve.runtime.engine import Engine
from dietserve.runtime.traffic import Traffic
from dietserve.runtime.versions import VersionStore

from .conftest import MAX_BATCH
from .scrape import metrics, total
from .server_process import REPO_ROOT, ServerProcess

pytestmark = pytest.mark.slow
MODEL = "retune"
TRIALS = "6"
SHORT = (1, 2, 3, 4)  # every kernel chosen for weight streaming: slow on long sequences
LONG = 128  # the reranker's maximum
PACE_S = 0.3  # between long requests: traffic, not a saturating load that skews the job's timings


def _latency(url: str, ids: np.ndarray, repeats: int = 7) -> float:
    tensor = triton.InferInput("input_ids", list(ids.shape), "INT64")
    tensor.set_data_from_numpy(ids)
    with triton.InferenceServerClient(url) as client:
        client.infer(MODEL, [tensor])
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            client.infer(MODEL, [tensor], outputs=[triton.InferRequestedOutput("logits")])
            times.append(time.perf_counter() - started)
    # The fastest run, not the median: on a shared host a neighbour's spell only adds time, and
    # can move the median of a few runs far for the same version.
    return min(times)


def test_drifted_traffic_is_retuned_and_swapped_in_faster(tmp_path: Path, cache_dir: Path, reranker_artifact):
    build = ["--model", str(reranker_artifact[0]), "--max-batch", str(MAX_BATCH), "--cache-dir", str(cache_dir)]
    engine = Engine(load_artifact(reranker_artifact[1]))
    records, store_dir = tmp_path / "records.jsonl", tmp_path / "store"
    short = Traffic(half_life_seconds=3600.0, as_of=0.0)
    for length in SHORT:
        short.record(1, length, now=0.0)
    short.save(tmp_path / "short.json")
    tuned = subprocess.run([sys.executable, "-m", "dietserve", "tune", *build, "--trials", TRIALS, "--lengths",
                            str(tmp_path / "short.json"), "--db", str(records), "--out", str(tmp_path / "short")],
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200)
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    store = VersionStore(store_dir)
    store.publish(Path(tuned.stdout.strip().splitlines()[-1]), tuned_for=tmp_path / "short.json",
                  plans=tmp_path / "short" / "plans")

    server = ServerProcess(None, "--artifact-store", str(store_dir), "--no-batching", "--watch-seconds", "0.5",
                           "--traffic-file", str(tmp_path / "traffic.json"), "--traffic-save-seconds", "0.5",
                           "--retune", "--retune-min-rows", "10", "--retune-min-interval", "600",
                           "--retune-check-seconds", "1", "--retune-trials", TRIALS, "--retune-db", str(records),
                           "--retune-min-gain", "0",
                           *build, model_name=MODEL)
    rng = np.random.default_rng(5)
    cases = [rng.integers(1000, 5000, size=(1, int(n))) for n in rng.integers(64, LONG + 1, size=6)]
    expected = [engine.run(ids).logits for ids in cases]
    failures, answered, stop = [], [0], threading.Event()

    def long_traffic() -> None:
        with triton.InferenceServerClient(server.grpc_url) as client:
            while not stop.is_set():
                index = answered[0] % len(cases)
                tensor = triton.InferInput("input_ids", list(cases[index].shape), "INT64")
                tensor.set_data_from_numpy(cases[index])
                try:
                    got = client.infer(MODEL, [tensor], client_timeout=120).as_numpy("logits")
                    if not np.allclose(got, expected[index], atol=1e-4):
                        failures.append(f"case {index}: max error {np.abs(got - expected[index]).max():.2e}")
                except triton.InferenceServerException as err:
                    failures.append(str(err))
                answered[0] += 1
                stop.wait(PACE_S)

    probe = np.full((1, LONG), 2000, np.int64)
    try:
        before = _latency(server.grpc_url, probe, repeats=15)
        traffic = threading.Thread(target=long_traffic)
        traffic.start()
        deadline = time.monotonic() + 1500
        while (total(metrics(server), "dietserve_swaps_total") < 1
               and store.rejected(2) is None):
            assert time.monotonic() < deadline, "no swap:\n" + server.log()[-3000:]
            assert server.process.poll() is None, server.log()
            time.sleep(2)
        time.sleep(4)  # the same long shapes on the new version: the measured gain
        stop.set()
        traffic.join(timeout=300)
        # (One job: the next may start only --retune-min-interval after it.)
        while (total(metrics(server), "dietserve_retune_running") > 0
               or store.newer_candidate(store.current()) is not None):
            assert time.monotonic() < deadline, "a re-tuning job still running:\n" + server.log()[-3000:]
            time.sleep(2)
        after = _latency(server.grpc_url, probe, repeats=15)
        time.sleep(1)
        samples = metrics(server)
    finally:
        stop.set()
        server.stop()
    log = server.log()
    assert failures == [] and answered[0] > 5, failures[:5]
    assert "re-tuning (drift" in log and "published (exit 0)" in log
    assert total(samples, "dietserve_retune_runs_total", outcome="published") >= 1
    assert store.tuned_for(2) is not None and store.retune_summary(2)["predicted_gain"] > 0
    refusal = store.rejected(2)
    if refusal is not None:
        # The job's kernels, timed beside serving, were slower: refused, and the policy holds back
        # a run on the mix that job tuned for (test_retune_policy.py) until the traffic moves.
        print(f"seq {LONG}: {before * 1e3:.1f} ms tuned for short sequences; the re-tune refused: {refusal}")
        measured = re.search(r"measured ([0-9.]+)x the served version's speed", refusal).group(1)
        assert float(measured) < 0.9 and f"version 2 not swapped in: measured {measured}x" in log, refusal
        assert "changed nothing served (its version was not swapped in)" in log
        assert log.count("re-tuning (drift") == 1, log[-3000:]
    else:
        checked = total(samples, "dietserve_swap_checked_gain")  # version 2 timed against version 1 before swapping
        print(f"seq {LONG}: {before * 1e3:.1f} ms tuned for short sequences, {after * 1e3:.1f} ms after the "
              f"re-tune (timed at {checked:.2f}x before the swap)")
        # The gain is judged by the server's own side-by-side check (the swap's gate), not by the
        # probe's wall times before and after: those are minutes apart on a shared host, and a
        # millisecond request moves further between them than any gain, for the same kernels.
        assert store.current() == 2 and checked >= 0.9
        assert total(samples, "dietserve_swap_measured_gain") > 0.5  # the server's own view of the same shapes
        # The job's prediction from the plans' own latencies over the recorded traffic, as exported.
        assert total(samples, "dietserve_swap_predicted_gain") == store.retune_summary(2)["predicted_gain"]
