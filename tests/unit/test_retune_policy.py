"""The re-tuning policy's decisions, with a real child process standing in for the tuning job."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from dietserve.runtime.traffic import Traffic
from dietserve.runtime.versions import VersionStore
from dietserve.server.metrics import ModelMetrics, ServerMetrics
from dietserve.server.retune import EXIT_NOT_FASTER, JobSlot, RetunePolicy, RetuneSettings
from dietserve.server.swap import HotSwap
from dietserve.server.traffic_log import TrafficLog

EDGES = [8, 16, 32, 64, 128, 256, 512]


def _policy(tmp_path: Path, exit_code: int, publish: bool = False, body: str = "", slot: JobSlot | None = None,
            metrics: ServerMetrics | None = None, model: str = "m",
            **settings) -> tuple[RetunePolicy, ModelMetrics, list[str]]:
    tmp_path = tmp_path / model
    artifact = tmp_path / "artifact"
    artifact.mkdir(parents=True)
    (artifact / "manifest.json").write_text(json.dumps({}))
    short = Traffic(3600.0, time.time())
    for length in (3, 5, 7):
        short.record(1, length, time.time())
    short.save(tmp_path / "short.json")
    store = VersionStore(tmp_path / "store")
    version = store.publish(artifact, tuned_for=tmp_path / "short.json")
    metrics, said = (metrics or ServerMetrics()).for_model(model), []

    def command(store_root: Path, traffic: Path) -> list[str]:
        assert Traffic.load(traffic).weights  # the job gets a snapshot of the traffic
        # (``publish``: as the real job does, a new version tuned for the snapshot)
        publishing = (f"from dietserve.runtime.versions import VersionStore; "
                      f"VersionStore({str(store_root)!r}).publish({str(artifact)!r}, tuned_for={str(traffic)!r}); "
                      if publish else "")
        return [sys.executable, "-c", f"{publishing}{body}import sys; sys.exit({exit_code})"]

    policy = RetunePolicy(RetuneSettings(command=command, **settings), HotSwap(store, version, lambda p: None),
                          TrafficLog(None, 3600.0, metrics), EDGES, 512, metrics, said.append, slot)
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


def _record(policy: RetunePolicy, length: int, count: int) -> None:
    now = time.time()
    for _ in range(count):
        policy.traffic.traffic.record(1, length, now)


def test_after_a_job_that_found_nothing_faster_the_next_waits_for_the_traffic_to_move(tmp_path):
    policy, metrics, said = _policy(tmp_path, EXIT_NOT_FASTER, drift_threshold=0.5, min_rows=1,
                                    min_interval_seconds=0)
    _record(policy, 400, 10)
    policy.step()
    _finish(policy)
    assert metrics.retune_runs.labels("not-faster")._value.get() == 1
    for _ in range(3):
        policy.step()
        assert policy.process is None  # drift 1.0 from the served mix, 0.0 from the one just tried
    assert metrics.traffic_drift._value.get() == 1.0
    assert sum("not re-tuning: drift 1.00 from the served version, but 0.00" in line for line in said) == 1
    _record(policy, 100, 30)  # now 75% of the rows are in a bucket the tried mix does not hold
    policy.step()
    assert policy.process is not None
    _finish(policy)
    assert metrics.retune_runs.labels("not-faster")._value.get() == 2


def test_a_published_version_the_swap_refused_holds_back_a_run_on_the_same_traffic(tmp_path):
    policy, metrics, said = _policy(tmp_path, 0, publish=True, drift_threshold=0.5, min_rows=1,
                                    min_interval_seconds=0)
    store = policy.hot_swap.store
    _record(policy, 400, 10)
    policy.step()
    _finish(policy)
    assert metrics.retune_runs.labels("published")._value.get() == 1 and store.versions() == [1, 2]
    policy.step()
    assert policy.process is None  # version 2 waits for the hot swap
    store.reject(2, "timed at 0.85x the served version's speed")  # the swap's refusal
    policy.step()
    assert policy.process is None
    assert any("changed nothing served (its version was not swapped in)" in line for line in said)
    _record(policy, 100, 30)
    policy.step()
    assert policy.process is not None  # the traffic moved away from what version 2 was tuned for
    _finish(policy)


def test_a_host_tune_that_changes_nothing_keeps_the_served_version_as_tuned(tmp_path):
    """So a restart serves it without tuning the host again; a drift job's refusal marks nothing."""
    for start_reason, kept in (("no tuned version for this host", True), (None, False)):
        folder = tmp_path / str(kept)
        policy, _metrics, said = _policy(folder, 0, publish=True, start_reason=start_reason,
                                         drift_threshold=0.5, min_rows=1, min_interval_seconds=0)
        store = policy.hot_swap.store
        assert not store.tuned(1)
        _record(policy, 400, 10)
        policy.step()
        _finish(policy)
        store.reject(2, "timed at 0.84x the served version's speed")  # the swap's refusal
        policy.step()
        assert policy.process is None and store.tuned(1) is kept, said
        if kept:
            assert "its version was not swapped in" in store.path(1).joinpath("KEPT").read_text()


def test_a_swapped_in_version_is_the_reference(tmp_path):
    policy, metrics, said = _policy(tmp_path, 0, publish=True, drift_threshold=0.5, min_rows=1,
                                    min_interval_seconds=0)
    _record(policy, 400, 10)
    policy.step()
    _finish(policy)
    policy.hot_swap.version = 2  # the swap took it: tuned for the 400-token traffic
    policy.step()
    assert policy.process is None and metrics.traffic_drift._value.get() == 0.0
    assert not any("changed nothing served" in line for line in said)


def test_a_failed_job_is_retried_on_the_same_traffic(tmp_path):
    failing, metrics, _ = _policy(tmp_path, 2, drift_threshold=0.5, min_rows=1, min_interval_seconds=0)
    _record(failing, 400, 10)
    failing.step()
    _finish(failing)
    failing.step()  # a crash is no verdict on the traffic: run again (after the interval, here 0)
    assert failing.process is not None
    _finish(failing)
    assert metrics.retune_runs.labels("failed")._value.get() == 2


def test_one_job_at_a_time_across_models_and_the_waiting_one_starts_after(tmp_path):
    """Two models served from two stores drift at once: the second model's job waits for the
    first's to end, then starts; each model's outcome is counted under its own label."""
    slot, metrics = JobSlot(), ServerMetrics()
    first, first_metrics, _ = _policy(tmp_path, 0, slot=slot, metrics=metrics, model="embedder",
                                      drift_threshold=0.5, min_rows=1, min_interval_seconds=0,
                                      body="import time; time.sleep(1); ")
    second, second_metrics, said = _policy(tmp_path, EXIT_NOT_FASTER, slot=slot, metrics=metrics, model="reranker",
                                           drift_threshold=0.5, min_rows=1, min_interval_seconds=0)
    _record(first, 400, 10)
    _record(second, 400, 10)
    first.step()
    second.step()
    second.step()
    assert first.process is not None and second.process is None
    assert sum("waits: another model's job is running" in line for line in said) == 1
    _finish(first)
    second.step()
    assert second.process is not None
    _finish(second)
    assert first_metrics.retune_runs.labels("published")._value.get() == 1
    assert second_metrics.retune_runs.labels("not-faster")._value.get() == 1
    assert second_metrics.retune_runs.labels("published")._value.get() == 0
    assert slot.holder is None


_HOLD_LOCK = """
import sys, time
from dietserve.runtime.versions import RETUNE_LOCK, VersionStore
lock = VersionStore(sys.argv[1]).lock(RETUNE_LOCK)
assert lock.acquire(wait=False)
print("held", flush=True)
time.sleep(120)
"""


def test_a_job_waits_while_another_server_runs_one_on_the_same_store(tmp_path):
    """Replicas sharing a store: another process (a server on another node) holds the store's
    re-tuning lock, so this server's job waits; once that process is gone it starts."""
    policy, metrics, said = _policy(tmp_path, 0, drift_threshold=0.5, min_rows=1, min_interval_seconds=0)
    other = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(policy.hot_swap.store.root)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        _record(policy, 400, 10)
        policy.step()
        policy.step()
        assert policy.process is None
        assert sum(f"waits: another server's job on {policy.hot_swap.store.root}" in line for line in said) == 1
    finally:
        other.kill()
        other.wait()
    policy.step()  # the kernel dropped the dead holder's lock
    assert policy.process is not None
    _finish(policy)
    assert metrics.retune_runs.labels("published")._value.get() == 1


def test_tuning_at_start_is_dropped_once_another_servers_job_tuned_the_served_version(tmp_path):
    policy, _metrics, said = _policy(tmp_path, 0, publish=True, start_reason="no tuned version for this host",
                                     drift_threshold=0.5, min_rows=1, min_interval_seconds=0)
    store = policy.hot_swap.store
    (store.path(policy.hot_swap.version) / "plans").mkdir()  # as another server's job left it, swapped in
    policy.step()
    assert policy.process is None
    assert any("not tuning at start: version 1 is tuned (another server's job)" in line for line in said)


def test_stopping_kills_the_job_and_the_processes_it_started(tmp_path):
    """As the tuner's measurement workers are the job's children, stopping the server (or a job
    past its budget) kills its whole process group, not the job alone."""
    pid_file = tmp_path / "worker.pid"
    body = ("import subprocess, time; "
            "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(pid_file)!r}, 'w').write(str(worker.pid)); time.sleep(120); ")
    policy, _metrics, _ = _policy(tmp_path, 0, body="import sys; " + body, drift_threshold=0.5, min_rows=1,
                                  min_interval_seconds=0)
    policy.traffic.traffic.record(1, 300, time.time())
    policy.step()
    job = policy.process
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    worker = int(pid_file.read_text())
    policy.stop()
    assert job.wait(10) == -9
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(worker)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie awaiting its reaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
