"""The re-tuning policy's decisions, with a real child process standing in for the tuning job."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from dietserve.runtime.traffic import Traffic
from dietserve.runtime.versions import VersionStore
from dietserve.server.metrics import ServerMetrics
from dietserve.server.retune import EXIT_NOT_FASTER, RetunePolicy, RetuneSettings
from dietserve.server.swap import HotSwap
from dietserve.server.traffic_log import TrafficLog

EDGES = [8, 16, 32, 64, 128, 256, 512]


def _policy(tmp_path: Path, exit_code: int, **settings) -> tuple[RetunePolicy, ServerMetrics, list[str]]:
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    (artifact / "manifest.json").write_text(json.dumps({}))
    short = Traffic(3600.0, time.time())
    for length in (3, 5, 7):
        short.record(1, length, time.time())
    short.save(tmp_path / "short.json")
    store = VersionStore(tmp_path / "store")
    version = store.publish(artifact, tuned_for=tmp_path / "short.json")
    metrics, said = ServerMetrics(), []

    def command(store_root: Path, traffic: Path) -> list[str]:
        assert Traffic.load(traffic).weights  # the job gets a snapshot of the traffic
        return [sys.executable, "-c", f"import sys; sys.exit({exit_code})"]

    policy = RetunePolicy(RetuneSettings(command=command, **settings), HotSwap(store, version, lambda p: None),
                          TrafficLog(None, 3600.0, metrics), EDGES, 512, metrics, said.append)
    return policy, metrics, said


def _finish(policy: RetunePolicy) -> None:
    policy.process.wait(30)
    policy.step()


def test_a_job_starts_on_drift_once_enough_rows_and_its_outcome_is_counted(tmp_path):
    policy, metrics, said = _policy(tmp_path, 0, drift_threshold=0.5, min_rows=10, min_interval_seconds=0)
    now = time.time()
    for _ in range(9):
        policy.traffic.traffic.record(1, 300, now)
    policy.step()
    assert policy.process is None  # drift 1.0, but 9 rows < 10
    policy.traffic.traffic.record(1, 300, now)
    policy.step()
    assert policy.process is not None and metrics.retune_running._value.get() == 1
    _finish(policy)
    assert policy.process is None and metrics.retune_runs.labels("published")._value.get() == 1
    assert any("re-tuning (drift 1.00 >= 0.5)" in line for line in said)


def test_no_job_without_drift_or_before_the_minimum_interval(tmp_path):
    policy, metrics, _ = _policy(tmp_path, 2, drift_threshold=0.5, min_rows=1, min_interval_seconds=3600)
    now = time.time()
    for _ in range(20):
        policy.traffic.traffic.record(2, 6, now)  # the mix it was tuned for
    policy.step()
    assert policy.process is None and metrics.traffic_drift._value.get() == 0.0
    for _ in range(100):
        policy.traffic.traffic.record(1, 400, now)
    policy.step()
    assert policy.process is not None
    _finish(policy)
    assert metrics.retune_runs.labels("failed")._value.get() == 1
    policy.step()
    assert policy.process is None  # drifted still, but the last run started less than an hour ago


def test_a_job_that_predicts_no_gain_is_counted_as_not_faster(tmp_path):
    policy, metrics, said = _policy(tmp_path, EXIT_NOT_FASTER, drift_threshold=0.5, min_rows=1,
                                    min_interval_seconds=0)
    policy.traffic.traffic.record(1, 400, time.time())
    policy.step()
    _finish(policy)
    assert metrics.retune_runs.labels("not-faster")._value.get() == 1
    assert metrics.retune_runs.labels("failed")._value.get() == 0
    assert any("not-faster (exit 3)" in line for line in said)
