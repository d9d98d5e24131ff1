"""Measurement in worker processes: a crashing or hanging candidate costs only itself, results
are checked against numpy before they count, and a real TVM RPC tracker + server measure too."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from dietserve.kernels.plan.kernel_plan import KernelPlan
from dietserve.kernels.plan.microkernel import MicroKernel
from tuner.database.records import RecordDatabase
from tuner.measure.job import MeasureJob, build_key
from tuner.measure.runner import BUILDS_KEPT, LocalRunner, MeasureOptions, RPCRunner
from tuner.measure.timing import TimingPolicy
from tuner.ops import dense
from tuner.task import ShapeVar, TuningTask
from tuner.tune import TuneOptions, Tuner

TARGET = {"kind": "llvm", "num-cores": 2}
FAULTY = "tests.unit.faulty_schedules:crash_or_hang"


def kernel(mr: int, nr: int = 8) -> MicroKernel:
    return MicroKernel(tile=(("i", (mr, 2)), ("j", (nr, 2)), ("k", (1,))), vector=8)


def job(k: MicroKernel, apply: str = "dietserve.kernels.apply:apply_kernel",
        shapes=({"T": 5}, {"T": 64})) -> MeasureJob:
    return MeasureJob(recipe=("dense", 64, 48, "bias_gelu"), target=TARGET, kernel=k.to_json(), shapes=shapes,
                      check_shape={"T": 13}, apply=apply)


def options(repeat: int = 1, **changes) -> MeasureOptions:
    return MeasureOptions(timing=TimingPolicy(number=1, repeat=repeat), **changes)


def test_crashing_and_hanging_candidates_cost_only_themselves() -> None:
    with LocalRunner(options(timeout_s=8)) as runner:
        good = runner.run(job(kernel(4)))
        assert good.ok and len(good.latencies) == 2
        crashed = runner.run(job(kernel(2), FAULTY))
        assert "died" in crashed.error and "SIGSEGV" in crashed.error
        started = time.monotonic()
        hung = runner.run(job(kernel(3), FAULTY))
        assert "timeout" in hung.error and time.monotonic() - started < 60
        again = runner.run(job(kernel(4), FAULTY))  # a fresh worker takes over
        assert again.ok and again.latencies[1] > 0


def test_a_wrong_kernel_is_rejected_before_its_time_counts() -> None:
    with LocalRunner(options(timeout_s=60)) as runner:
        result = runner.run(job(kernel(4), "tests.unit.test_tuner_measure:wrong_schedule"))
    assert result.error.startswith("wrong result on {'T': 13}")
    assert result.latencies == ()


def test_a_kernel_is_built_once_for_every_shape_it_is_timed_on() -> None:
    """Kernels are symbolic in the shape: the worker keeps a checked build and times it on the
    next shape it is asked for without building it again; another kernel is built, and a wrong
    one is rejected each time it comes (never kept)."""
    wrong = "tests.unit.test_tuner_measure:wrong_schedule"
    with LocalRunner(options(timeout_s=60)) as runner:
        first = runner.run(job(kernel(4)))
        again = runner.run(job(kernel(4), shapes=({"T": 7},)))
        other = runner.run(job(kernel(2)))
        rejected = [runner.run(job(kernel(4), wrong)) for _ in range(2)]
    assert first.ok and not first.build_reused
    assert again.ok and again.build_reused and len(again.latencies) == 1
    assert other.ok and not other.build_reused
    assert all(result.error.startswith("wrong result on") for result in rejected)


def test_candidates_built_ahead_are_all_timed_in_one_worker() -> None:
    """``prepare`` builds a round's candidates on two workers at once: the second only compiles
    them into libraries, and every timing runs in the first (a worker that has run a kernel
    keeps its thread pool spinning, which slowed kernels timed in the other up to 3x). Each is
    timed without a second build, and a build that failed ahead (a wrong result, a crash) comes
    back as that candidate's result alone."""
    wrong = "tests.unit.test_tuner_measure:wrong_schedule"
    jobs = [job(kernel(4)), job(kernel(1)), job(kernel(3), wrong), job(kernel(2))]
    with LocalRunner(options(timeout_s=60, workers=2)) as runner:
        runner.prepare(jobs)
        compiled = [build_key(runner._work(each)) in runner._compiled for each in jobs]
        results = [runner.run(each) for each in jobs]
        again = runner.run(job(kernel(4), shapes=({"T": 7},)))
        # each worker's threads: the timing worker's TVM pool adds its own, a builder starts none
        threads = [len(os.listdir(f"/proc/{each.process.pid}/task")) for each in runner._workers]
        crashing = [job(kernel(2), FAULTY), job(kernel(4), FAULTY), job(kernel(1), FAULTY)]
        runner.prepare(crashing)
        crash_results = [runner.run(each) for each in crashing]
    assert any(compiled) and not all(compiled)  # each worker took a share
    for good in results[:2] + results[3:]:
        assert good.ok and len(good.latencies) == 2
        assert good.built_ahead and good.build_seconds > 0 and not good.build_reused
    assert results[2].error.startswith("wrong result on") and results[2].latencies == ()
    assert again.ok and again.build_reused and not again.built_ahead
    crashed = [result for result in crash_results if not result.ok]
    assert len(crashed) == 1 and "died" in crashed[0].error and "SIGSEGV" in crashed[0].error
    assert all(result.latencies[1] > 0 for result in crash_results if result.ok)
    assert threads[1] < threads[0]


def wrong_schedule(func, kernel, target, loop_partition=False):
    """A "schedule" with the same signature that computes something else: no GELU."""
    from dietserve.kernels.apply import apply_kernel
    from tuner.ops import dense

    return apply_kernel(dense(64, 48, "bias").func, kernel, target)


def test_tuning_goes_on_past_crashes_and_hangs(tmp_path: Path) -> None:
    task = TuningTask.create(dense(64, 48, "bias"), TARGET, ShapeVar("T", [1, 5, 13, 64]))
    space = [kernel(mr, nr) for mr in (1, 2, 3, 4) for nr in (8, 16)]
    database = RecordDatabase(tmp_path / "records.jsonl")
    with LocalRunner(options(timeout_s=6)) as runner:
        result = Tuner(task, space, 2, runner, database, TuneOptions(trials=8, apply=FAULTY, seed=1)).run()
    records = list(database.records())
    assert result.trials == len(records) == 8
    errors = [r.error for r in records if not r.ok]
    assert result.failures == len(errors) >= 1
    assert all("died" in e or "timeout" in e for e in errors)
    for name in result.plan.variants:  # only kernels that measured fine are dispatched to
        chosen = result.plan.kernel(name)
        assert chosen is None or chosen.tile_sizes("i")[0] not in (2, 3)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def rpc_tracker():
    """A real TVM RPC tracker with one CPU server registered under the key "cpu"."""
    port, server_port = _free_port(), _free_port()
    # Each in a process group of its own: the server runs every session in a worker process, and
    # a worker outlives a server killed alone (two 530 MB orphans per test run until this).
    tracker = subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1",
                                "--port", str(port), "--port-end", str(port + 1)], stderr=subprocess.DEVNULL,
                               start_new_session=True)
    time.sleep(2)
    server = subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_server", "--tracker", f"127.0.0.1:{port}",
                               "--key", "cpu", "--host", "127.0.0.1", "--port", str(server_port),
                               "--port-end", str(server_port + 1)], stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = subprocess.run([sys.executable, "-m", "tvm.exec.query_rpc_tracker", "--host", "127.0.0.1",
                                     "--port", str(port)], capture_output=True, text=True)
            if "cpu" in status.stdout and "free" not in status.stdout.split("cpu")[0][-5:]:
                break
            time.sleep(1)
        yield f"127.0.0.1:{port}"
    finally:
        for process in (server, tracker):
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_rpc_runner_measures_on_a_registered_device(rpc_tracker: str) -> None:
    with RPCRunner(rpc_tracker, "cpu", options(repeat=2, timeout_s=90)) as runner:
        result = runner.run(job(kernel(4)))
        second = runner.run(job(kernel(1, 16)))  # same session, a different library
    assert result.ok, result
    assert second.ok, second
    assert 0 < result.latencies[0] < result.latencies[1] * 10


def test_cli_tunes_then_the_records_report_with_a_plot(tmp_path: Path) -> None:
    database = tmp_path / "records.jsonl"
    tune = subprocess.run(
        [sys.executable, "-m", "tuner", "tune", "--op", "dense", "--k", "64", "--n", "64", "--epilogue", "bias_gelu",
         "--t", "1:64", "--trials", "6", "--db", str(database), "--number", "1", "--repeat", "1"],
        capture_output=True, text=True, timeout=600,
    )
    assert tune.returncode == 0, tune.stderr
    assert "6/6 trials" in tune.stderr
    plan = json.loads(database.with_suffix(".plan.json").read_text())
    assert plan["tuned_range"] == {"var": "T", "min": 1, "max": 64} and len(plan["shapes"]) == 64 and plan["variants"]
    # Where the chosen variant and the untuned kernel were both measured, the choice is no slower,
    # unless the plan reads the weight packed: the untuned kernel (which reads it unpacked) cannot
    # join such a plan, so the guard yields there and the layouts' comparison prices the shape
    # (test_tuner_packing covers that rule).
    both = [row for row in plan["shapes"] if row["measured"] and row["default_measured"]]
    slower = [row for row in both if row["latency_s"] > row["default_latency_s"]]
    packed = KernelPlan.read(database.with_suffix(".plan.json")).pack > 0
    assert both and (not slower or packed), (slower, plan["variants"])
    report = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "benchmarks" / "records_report.py"),
                             "--db", str(database)], capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    assert "dense_bias_gelu[K=64,N=64]" in report.stdout and "best latency" in report.stdout
    assert database.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([sys.executable, "-m", "tuner", "tune", "--op", "dense", "--t", "1:8"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--k and --n" in bad.stderr


def test_the_runner_forgets_builds_the_timing_worker_has_evicted() -> None:
    """The runner's view of the timing worker's cache keeps what the worker keeps (its most
    recently used ``builds_kept``), so an evicted kernel is built ahead again, not assumed held."""
    with LocalRunner(MeasureOptions(workers=1)) as runner:
        assert runner._work(job(kernel(4))).builds_kept == BUILDS_KEPT  # what the worker is told to keep
        for index in range(BUILDS_KEPT + 3):
            runner._held(f"k{index}")
        runner._held("k3")  # used again: most recent
        runner._held("new")
        assert len(runner._timed) == BUILDS_KEPT
        assert "k3" in runner._timed and "k4" not in runner._timed and "k0" not in runner._timed


def test_a_longer_tune_keeps_every_build_it_makes() -> None:
    """``python -m tuner tune`` measures 256 trials by default: its workers keep that many builds
    (and the default kernel's), so the verification rebuilds nothing; a short tune keeps the
    worker's floor."""
    from tuner.cli import _measure_options, build_parser

    long = _measure_options(build_parser().parse_args(["tune", "--op", "dense", "--k", "8", "--n", "8", "--t", "1:8"]))
    short = _measure_options(build_parser().parse_args(["tune", "--op", "dense", "--k", "8", "--n", "8", "--t", "1:8",
                                                        "--trials", "16"]))
    assert long.builds_kept == 257 and short.builds_kept == BUILDS_KEPT
    with LocalRunner(replace(long, workers=1)) as runner:
        for index in range(300):
            runner._held(f"k{index}")
        assert len(runner._timed) == 257 and runner._work(job(kernel(4))).builds_kept == 257
    with pytest.raises(ValueError, match="builds_kept"):
        MeasureOptions(builds_kept=0)
