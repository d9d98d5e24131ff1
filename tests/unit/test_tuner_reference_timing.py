"""Candidates timed beside a reference kernel of their shape (``measure/beside.py``,
``reference_scale.py``): a host whose speed moves between timings must not rank a shape's
kernels by the spell each met. The paired timing and the scale's bookkeeping against synthetic
timings whose true ratios are known; the worker's paired timing with a real build."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from dietserve.kernels.microkernel import MicroKernel
from tuner.database.records import RecordDatabase
from tuner.dispatch import shape_key
from tuner.measure.beside import timed_beside
from tuner.measure.runner import LocalRunner, MeasureOptions
from tuner.ops import dense
from tuner.options import TuneOptions
from tuner.reference_scale import SWITCH_RATIO, ReferenceScale
from tuner.task import ShapeVar, TuningTask
from tuner.tune import Tuner


def tile(rows: int, threads: int = 0) -> MicroKernel:
    return MicroKernel(tile=(("i", (rows,)), ("j", (16, 1, 1)), ("k", (1,))), vector=8, pack=16, threads=threads)


def test_the_ratio_is_taken_round_by_round_and_the_order_alternates() -> None:
    """The host runs 1x, 3x, 1x, 3x, 1x slower round by round: the medians read the spells, the
    ratio does not; each round's first turn alternates between the two."""
    slowdowns = iter([1, 1, 3, 3, 1, 1, 3, 3, 1, 1])  # two turns a round
    order = []

    def turn(name: str, seconds: float):
        def run() -> float:
            order.append(name)
            return seconds * next(slowdowns)
        return run

    beside = timed_beside(turn("candidate", 0.8e-3), turn("reference", 1e-3), rounds=5)
    assert beside.ratio == pytest.approx(0.8)
    assert beside.candidate_s == pytest.approx(0.8e-3) and beside.reference_s == pytest.approx(1e-3)
    assert order[:4] == ["reference", "candidate", "candidate", "reference"]
    with pytest.raises(ValueError, match="at least one round"):
        timed_beside(turn("candidate", 1.0), turn("reference", 1.0), rounds=0)


class DriftingMachine:
    """Each job reads ``true seconds x the host's slowdown at the time`` (taken in turn from
    ``slowdowns``); where the job names a reference, the reference is timed in the same spell
    and the ratio of the true times comes back with it, as the worker returns it."""

    def __init__(self, true_s: dict[MicroKernel, float], slowdowns: list[float]) -> None:
        self.true_s = true_s
        self.slowdowns = itertools.cycle(slowdowns)
        self.jobs: list[dict] = []

    def describe(self) -> str:
        return "synthetic, drifting"

    def run(self, job: dict) -> dict:
        self.jobs.append(job)
        slowdown = next(self.slowdowns)
        kernel = MicroKernel.from_json(job["kernel"])
        result = {"latencies": {"T=64": self.true_s[kernel] * slowdown}, "error": None, "build_seconds": 0.0,
                  "others_share": 0.0}
        if "reference" in job:
            reference = MicroKernel.from_json(job["reference"]["kernel"])
            result["references"] = {"T=64": {"seconds": self.true_s[reference] * slowdown,
                                             "ratio": self.true_s[kernel] / self.true_s[reference]}}
        return result


def _tuner(machine, tmp_path: Path, kernels: list[MicroKernel], reference_timing: bool = True) -> Tuner:
    task = TuningTask.create(dense(768, 768, "bias"), {"kind": "llvm", "num-cores": 2}, ShapeVar("T", (64,)))
    return Tuner(task, kernels, 2, machine, RecordDatabase(tmp_path / "records.jsonl"),
                 TuneOptions(trials=16, reference_timing=reference_timing))


def test_kernels_timed_in_different_spells_rank_as_they_run(tmp_path: Path) -> None:
    """Four kernels 10% apart, the fastest timed in the slowest spell: timed alone it reads
    slowest; on the reference's scale they rank as they run, at the reference's level."""
    kernels = [tile(rows) for rows in (4, 5, 6, 7)]
    true_s = dict(zip(kernels, [1.0e-3, 0.9e-3, 0.81e-3, 0.73e-3], strict=True))
    slowdowns = [1.0, 1.0, 1.2, 2.0]
    key = shape_key({"T": 64})
    alone = _tuner(DriftingMachine(true_s, slowdowns), tmp_path / "alone", kernels, reference_timing=False)
    scaled = _tuner(machine := DriftingMachine(true_s, slowdowns), tmp_path / "scaled", kernels)
    for tuner in (alone, scaled):
        for kernel in kernels:
            tuner.measure(kernel, {"T": 64})
    assert min(alone.measured[key], key=alone.measured[key].get) != kernels[3]  # the premise
    assert sorted(scaled.measured[key], key=scaled.measured[key].get) == kernels[::-1]
    assert "reference" not in machine.jobs[0] and all(job["reference"]["kernel"] == kernels[0].to_json()
                                                     for job in machine.jobs[1:])
    level = scaled.scale.level(key)  # the reference's median over its 4 timings: 1.0, 1.0, 1.2, 2.0 ms
    assert level == pytest.approx(1.1e-3)
    for kernel in kernels:
        assert scaled.measured[key][kernel] == pytest.approx(true_s[kernel] / true_s[kernels[0]] * level)


def test_the_reference_is_the_first_kernel_on_every_core_and_gives_way_to_a_much_faster_one() -> None:
    key = shape_key({"T": 64})
    scale = ReferenceScale()
    serial, first, faster = tile(4, threads=1), tile(5), tile(6)
    assert scale.timed(key, serial, 2e-3, None, {}) == {serial: 2e-3}  # serial: no reference
    assert scale.timed(key, first, 4e-3, None, {serial: 2e-3}, hopeless=True) == {first: 4e-3}  # hopeless
    assert scale.timed(key, first, 1e-3, None, {serial: 2e-3}) == {serial: 2e-3, first: 1e-3}
    assert scale.reference(key) == first
    # A candidate a bit faster stays a candidate; one SWITCH_RATIO faster takes over, the scale kept.
    scale.timed(key, tile(7), 0.9e-3, {"seconds": 1e-3, "ratio": 0.9}, {})
    assert scale.reference(key) == first
    kept = scale.timed(key, faster, 0.5e-3, {"seconds": 1e-3, "ratio": 1 / SWITCH_RATIO}, {})
    assert scale.reference(key) == faster
    assert kept[faster] == pytest.approx(1e-3 / SWITCH_RATIO) and kept[first] == pytest.approx(1e-3)
    assert kept[serial] == pytest.approx(2e-3) and kept[tile(7)] == pytest.approx(0.9e-3)
    # Timed without the reference beside it (a hopeless probe): at its latency over the level.
    assert scale.timed(key, tile(8), 3e-3, None, {})[tile(8)] == pytest.approx(3e-3)


def test_a_raced_time_keeps_its_place_when_the_level_moves_later(tmp_path: Path) -> None:
    """A race's time (``race._keep_level``) joins the scale as its ratio to the level then: when a
    later timing moves the level, it moves with the shape's other kernels."""
    kernels = [tile(4), tile(5), tile(6)]
    true_s = dict(zip(kernels, [1e-3, 0.9e-3, 0.8e-3], strict=True))
    tuner = _tuner(DriftingMachine(true_s, [1.0, 2.0, 3.0]), tmp_path, kernels)
    key = shape_key({"T": 64})
    tuner.measure(kernels[0], {"T": 64})
    tuner.measure(kernels[1], {"T": 64})  # the reference read 1 and 2 ms: level 1.5 ms
    tuner.set_measured(kernels[1], key, 0.75e-3)  # a race's time: half the reference's
    tuner.measure(kernels[2], {"T": 64})  # the reference read 3 ms: level 2 ms
    assert tuner.scale.level(key) == pytest.approx(2e-3)
    assert tuner.measured[key][kernels[0]] == pytest.approx(2e-3)
    assert tuner.measured[key][kernels[1]] == pytest.approx(1e-3)
    assert tuner.measured[key][kernels[2]] == pytest.approx(1.6e-3)


TARGET = {"kind": "llvm", "num-cores": 2}


def _job(kernel: MicroKernel, reference: MicroKernel | None = None,
         reference_apply: str = "dietserve.kernels.apply:apply_kernel", **extra) -> dict:
    job = {"recipe": ("dense", 64, 48, "bias_gelu"), "target": TARGET, "kernel": kernel.to_json(),
           "shapes": [{"T": 64}], "check_shape": {"T": 13}, "apply": "dietserve.kernels.apply:apply_kernel", **extra}
    if reference is not None:
        job["reference"] = {"kernel": reference.to_json(), "apply": reference_apply}
    return job


def test_a_real_worker_times_the_candidate_beside_its_reference() -> None:
    """Built and checked kernels, timed in alternate turns: the ratio agrees with the two medians;
    a reference that fails its check leaves the candidate timed alone."""
    small = MicroKernel(tile=(("i", (4, 2)), ("j", (8, 2)), ("k", (1,))), vector=8)
    other = MicroKernel(tile=(("i", (2, 2)), ("j", (8, 2)), ("k", (1,))), vector=8)
    with LocalRunner(MeasureOptions(number=1, repeat=5, timeout_s=60, workers=1)) as runner:
        assert runner.run(_job(other))["error"] is None
        paired = runner.run(_job(small, other))
        wrong = runner.run(_job(small, other, "tests.unit.test_tuner_measure:wrong_schedule"))
    assert paired["error"] is None
    beside = paired["references"]["T=64"]
    assert beside["seconds"] > 0 and paired["latencies"]["T=64"] > 0
    assert 0.5 < beside["ratio"] / (paired["latencies"]["T=64"] / beside["seconds"]) < 2.0
    assert wrong["error"] is None and wrong["references"] == {} and wrong["latencies"]["T=64"] > 0
