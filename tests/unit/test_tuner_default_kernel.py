"""The default rule's kernel in a tune: where it is far behind the best kernel measured (or,
before any, predicted) on a shape, the worker times it once and no more (``abandon_above_s``),
as it does a hopeless candidate. Against the synthetic machine, which records the jobs it gets;
``TimingPolicy.time`` reads the bar."""

from __future__ import annotations

from pathlib import Path

import pytest

from dietserve.kernels.plan.microkernel import MicroKernel
from tuner.database.records import RecordDatabase
from tuner.measure.timing import ABANDON_FACTOR
from tuner.measurements import shape_key
from tuner.ops import dense
from tuner.phases import Probe
from tuner.task import ShapeVar, TuningTask
from tuner.tune import TuneOptions, Tuner

from .fake_runner import FakeRunner

KERNEL = MicroKernel(tile=(("i", (6,)), ("j", (16, 1, 1)), ("k", (1,))), vector=8, pack=16)
LATENCY_S = 1e-3


def RecordingMachine() -> FakeRunner:  # noqa: N802
    """Every kernel takes ``LATENCY_S``, the default one ten times as long."""
    return FakeRunner(lambda kernel, _shape: LATENCY_S * (10 if kernel is None else 1))


def _tuner(tmp_path: Path) -> tuple[Tuner, RecordingMachine]:
    machine = RecordingMachine()
    task = TuningTask.create(dense(768, 768, "bias"), {"kind": "llvm", "num-cores": 2}, ShapeVar("T", (1, 64)))
    return Tuner(task, [KERNEL], 2, machine, RecordDatabase(tmp_path / "records.jsonl"), TuneOptions(trials=8)), machine


def test_the_default_kernel_is_timed_once_where_it_is_far_behind_the_best_measured(tmp_path: Path) -> None:
    tuner, machine = _tuner(tmp_path)
    tuner.measure(Probe(KERNEL, {"T": 64}))
    tuner.measure(Probe(None, {"T": 64}))
    assert machine.jobs[-1].kernel is None
    assert machine.jobs[-1].abandon_above_s == pytest.approx(ABANDON_FACTOR * LATENCY_S)
    assert tuner.store.default[shape_key({"T": 64})] == pytest.approx(10 * LATENCY_S)


def test_before_any_measurement_there_the_bar_is_the_predicted_best(tmp_path: Path) -> None:
    tuner, machine = _tuner(tmp_path)
    tuner.measure(Probe(KERNEL, {"T": 64}))
    tuner.measure(Probe(None, {"T": 1}))
    predicted = tuner.best_latency({"T": 1})  # (nothing measured there: predicted)
    assert machine.jobs[-1].abandon_above_s == pytest.approx(ABANDON_FACTOR * predicted)


def test_with_nothing_measured_or_predicted_the_default_kernel_gets_every_repeat(tmp_path: Path) -> None:
    tuner, machine = _tuner(tmp_path)
    tuner.measure(Probe(None, {"T": 64}))
    assert machine.jobs[-1].abandon_above_s is None


def test_a_search_times_the_candidates_on_a_shape_before_the_default_kernel(tmp_path: Path) -> None:
    # So even the first shape's default kernel has a bar: the best candidate timed there.
    machine = RecordingMachine()
    task = TuningTask.create(dense(768, 768, "bias"), {"kind": "llvm", "num-cores": 2}, ShapeVar("T", (1, 64)))
    space = [MicroKernel(tile=(("i", (mr,)), ("j", (16, 1, 1)), ("k", (1,))), vector=8, pack=16) for mr in (2, 4, 6, 8)]
    tuner = Tuner(task, space, 2, machine, RecordDatabase(tmp_path / "records.jsonl"), TuneOptions(trials=8))
    tuner.run()
    defaults = [i for i, job in enumerate(machine.jobs) if job.kernel is None]
    first = defaults[0]
    shape = machine.jobs[first].shape
    assert machine.jobs[0].kernel is not None
    assert any(job.kernel is not None and job.shape == shape for job in machine.jobs[:first])
    assert machine.jobs[first].abandon_above_s == pytest.approx(ABANDON_FACTOR * LATENCY_S)
    assert all(machine.jobs[i].abandon_above_s is not None for i in defaults)
    assert set(tuner.store.default) == {shape_key({"T": 1}), shape_key({"T": 64})}
