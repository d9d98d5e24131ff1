"""Finalists raced before the plan (``tuner/race.py``): kernels the search timed at different
moments are timed again side by side, and the plan follows the race.

The planning tests run the tuner against a machine whose search timings carry a slow spell and
whose races report the truth (no build: what is tested is what the plan does with a race). The
last test races real kernels in a real worker."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dietserve.kernels.microkernel import MicroKernel
from tuner.database.records import RecordDatabase
from tuner.dispatch import shape_key
from tuner.measure.host_load import CONTENDED_SHARE
from tuner.measure.runner import LocalRunner, MeasureOptions
from tuner.ops import dense
from tuner.options import TuneOptions
from tuner.race import CONTENDED_RUNS, RACE_MARGIN, RACE_ROUNDS, race_finalists
from tuner.task import ShapeVar, TuningTask
from tuner.tune import Tuner
from tuner.weight_stream import DramRates

TARGET = {"kind": "llvm", "num-cores": 2}
SHAPES = (1, 8, 16, 32, 64)


def _packed(mr: int, tasks: int = 1) -> MicroKernel:
    return MicroKernel(tile=(("i", (mr,)), ("j", (16, 1, tasks)), ("k", (1,))), vector=8, pack=16)


FAST, SLOW = _packed(6), _packed(4)  # truly 1.0 and 1.1 of each other


class SpellMachine:
    """Each kernel's true time is ``truth[kernel]`` x T microseconds (the default kernel 3x a
    packed one); the search's timings of the kernels in ``spell`` read ``spell_factor`` slower
    (timed in a slow spell of the host). A race reports the truth (``raced_truth`` for one with
    the weight from DRAM), and keeps how each was raced."""

    device = {"kind": "local"}

    def __init__(self, truth: dict, spell: set, spell_factor: float = 1.3, raced_truth: dict | None = None,
                 busy: list[float] | None = None):
        self.truth, self.spell, self.spell_factor = truth, spell, spell_factor
        self.raced_truth = raced_truth or truth
        self.busy = list(busy or [])  # the share of the CPUs other work takes in each race, in turn
        self.jobs: list[dict] = []
        self.races: list[dict] = []

    def describe(self) -> str:
        return "synthetic, with a slow spell"

    def _true(self, truth: dict, kernel: MicroKernel | None, rows: int) -> float:
        return 1e-6 * rows * (3.0 if kernel is None else truth[kernel])

    def run(self, job: dict) -> dict:
        self.jobs.append(job)
        kernel = None if job["kernel"] is None else MicroKernel.from_json(job["kernel"])
        (shape,) = job["shapes"]
        latency = self._true(self.truth, kernel, shape["T"]) * (self.spell_factor if kernel in self.spell else 1.0)
        return {"latencies": {"T": latency}, "error": None, "build_seconds": 0.0}

    def race(self, job: dict) -> dict:
        self.races.append(job)
        (shape,) = job["shapes"]
        kernels = [None if k is None else MicroKernel.from_json(k) for k in job["kernels"]]
        truth = self.raced_truth if job["stream"] else self.truth
        return {"latencies": [self._true(truth, k, shape["T"]) for k in kernels],
                "errors": [None] * len(kernels), "error": None,
                "others_share": self.busy.pop(0) if self.busy else 0.0}


def _tuner(machine, tmp_path: Path, **options) -> Tuner:
    task = TuningTask.create(dense(768, 768, "bias"), TARGET, ShapeVar("T", SHAPES))
    tuner = Tuner(task, [FAST, SLOW], 2, machine, RecordDatabase(tmp_path / "records.jsonl"),
                  TuneOptions(trials=64, max_variants=1, **options))
    for shape in tuner.shapes:  # as a search would: every kernel on every shape, and the default
        tuner.measure_default(shape)
        for kernel in (FAST, SLOW):
            tuner.measure(kernel, shape)
    return tuner


def _chosen(tuner: Tuner) -> set[MicroKernel | None]:
    plan = tuner.plan()
    return {plan.kernel(row["variant"]) for row in plan.shapes}


def test_a_kernel_timed_in_a_slow_spell_wins_its_race_and_the_plan(tmp_path: Path) -> None:
    machine = SpellMachine({FAST: 1.0, SLOW: 1.1}, spell={FAST})
    tuner = _tuner(machine, tmp_path)
    assert _chosen(tuner) == {SLOW}  # what the search's timings alone choose
    trials, records = tuner.trials, (tmp_path / "records.jsonl").read_text()
    summary = race_finalists(tuner)
    assert _chosen(tuner) == {FAST}
    # Every shape raced once, its two finalists (the default is 3x: not one) side by side, hot.
    assert summary.shapes == summary.reordered == len(SHAPES) and summary.streamed == summary.failed == 0
    assert [race["shapes"][0]["T"] for race in machine.races] == list(SHAPES)
    assert all(len(race["kernels"]) == 2 and race["rounds"] == RACE_ROUNDS and not race["stream"]
               for race in machine.races)
    # A race is no trial and no record; the raced times keep the search's level (geometric mean).
    assert tuner.trials == trials and (tmp_path / "records.jsonl").read_text() == records
    key = shape_key({"T": 64})
    assert tuner.measured[key][FAST] * tuner.measured[key][SLOW] == \
        pytest.approx(64e-6 * 1.3 * 64e-6 * 1.1)
    assert tuner.measured[key][SLOW] / tuner.measured[key][FAST] == pytest.approx(1.1)


def test_the_best_serial_and_parallel_kernels_race_however_far_apart(tmp_path: Path) -> None:
    """A neighbour on one core slows kernels on both cores: timed in such a spell, the parallel
    tile read 1.6x slower than a serial one (beyond the margin), where it is 2x faster."""
    serial = MicroKernel(tile=(("i", (6,)), ("j", (16, 1, 1)), ("k", (1,))), vector=8, pack=16, threads=1)
    machine = SpellMachine({FAST: 1.0, serial: 2.0}, spell={FAST}, spell_factor=3.2)
    task = TuningTask.create(dense(768, 768, "bias"), TARGET, ShapeVar("T", SHAPES))
    tuner = Tuner(task, [FAST, serial], 2, machine, RecordDatabase(tmp_path / "records.jsonl"),
                  TuneOptions(trials=64, max_variants=1))
    for shape in tuner.shapes:
        tuner.measure_default(shape)
        for kernel in (FAST, serial):
            tuner.measure(kernel, shape)
    assert _chosen(tuner) == {serial}
    race_finalists(tuner)
    assert all(set(map(str, race["kernels"])) == {FAST.to_json(), serial.to_json()} for race in machine.races)
    assert _chosen(tuner) == {FAST}


def test_a_race_beside_other_work_is_run_again_and_then_leaves_the_search_times(tmp_path: Path) -> None:
    """The first shape's race runs while other work takes half the CPUs: run again, as busy,
    the shape keeps the search's times; the second's first run is busy and its second quiet,
    which counts; the rest are quiet."""
    busy = [0.5, 0.5, CONTENDED_SHARE * 1.5, CONTENDED_SHARE / 2]
    machine = SpellMachine({FAST: 1.0, SLOW: 1.1}, spell={FAST}, busy=busy)
    tuner = _tuner(machine, tmp_path)
    first, second = (shape_key({"T": t}) for t in SHAPES[:2])
    searched = dict(tuner.measured[first])
    summary = race_finalists(tuner)
    assert [race["shapes"][0]["T"] for race in machine.races] == [SHAPES[0]] * CONTENDED_RUNS + [SHAPES[1]] * 2 \
        + list(SHAPES[2:])
    assert summary.contended == 1 and summary.shapes == len(SHAPES) and summary.reordered == len(SHAPES) - 1
    assert tuner.measured[first] == searched  # (FAST still read 1.3x slow there)
    assert tuner.measured[second][SLOW] / tuner.measured[second][FAST] == pytest.approx(1.1)
    assert summary.describe()["races"]["contended"] == 1


def test_no_race_for_kernels_far_apart_when_turned_off_or_past_the_time_budget(tmp_path: Path) -> None:
    far = SpellMachine({FAST: 1.0, SLOW: RACE_MARGIN * 1.1}, spell=set())
    tuner = _tuner(far, tmp_path / "far")
    assert race_finalists(tuner).shapes == 0 and not far.races
    off = SpellMachine({FAST: 1.0, SLOW: 1.1}, spell={FAST})
    tuner = _tuner(off, tmp_path / "off", race=False)
    assert race_finalists(tuner).shapes == 0 and not off.races and _chosen(tuner) == {SLOW}
    late = SpellMachine({FAST: 1.0, SLOW: 1.1}, spell={FAST})  # the tune's time budget spent
    tuner = _tuner(late, tmp_path / "late")
    assert race_finalists(tuner, deadline=time.monotonic()).shapes == 0 and not late.races


def test_a_streamed_race_corrects_the_served_model_where_the_weight_stream_bounds(tmp_path: Path) -> None:
    """Timed hot the two tile shapes tie; with the weight from DRAM (the race) one streams 1.3x
    slower at the shapes one or two row passes cover, which the plan then follows, either way."""
    rates = DramRates(every_core=20e9, one_core=12e9)
    for faster, slower in ((FAST, SLOW), (SLOW, FAST)):
        machine = SpellMachine({FAST: 1.0, SLOW: 1.0}, spell=set(), raced_truth={faster: 1.0, slower: 1.3})
        tuner = _tuner(machine, tmp_path / str(faster.tile_sizes("i")[0]), dram=rates)
        race_finalists(tuner)
        streamed = {race["shapes"][0]["T"] for race in machine.races if race["stream"]}
        assert streamed == {1, 8}  # T <= 2 row passes of a 4-row tile; hot races above
        plan = tuner.plan()
        for row in plan.shapes:
            if row["value"] in streamed:
                assert plan.kernel(row["variant"]) == faster, row["value"]


def wrong_schedule(func, kernel, target, loop_partition=False):
    """A kernel computing another operator (the reference check must reject it)."""
    from dietserve.kernels.apply import apply_kernel

    return apply_kernel(dense(64, 48, "bias").func, kernel, target)


def test_a_real_race_times_every_entrant_and_drops_a_wrong_one() -> None:
    """In a real worker: the default kernel and a tiled one raced hot and from DRAM; a race
    whose tiled kernel computes the wrong thing times the default kernel alone."""
    tiled = MicroKernel(tile=(("i", (4, 2)), ("j", (8, 2)), ("k", (1,))), vector=8)
    job = {"recipe": ("dense", 64, 48, "bias_gelu"), "target": TARGET, "shapes": [{"T": 37}],
           "check_shape": {"T": 13}, "kernels": [None, tiled.to_json()], "rounds": 3,
           "apply": "dietserve.kernels.apply:apply_kernel"}
    with LocalRunner(MeasureOptions(number=1, repeat=1, min_repeat_ms=1, timeout_s=60, workers=1)) as runner:
        for stream in (False, True):
            result = runner.race({**job, "stream": stream})
            assert result["error"] is None and result["errors"] == [None, None]
            assert all(0 < t < 0.1 for t in result["latencies"]), result["latencies"]
            assert 0.0 <= result["others_share"] <= 1.0  # (what other work took: here, whatever it was)
        wrong = runner.race({**job, "stream": False, "apply": "tests.unit.test_tuner_race:wrong_schedule"})
    assert wrong["error"] is None and wrong["latencies"][0] > 0 and wrong["latencies"][1] is None
    assert wrong["errors"][0] is None and wrong["errors"][1].startswith("wrong result on {'T': 13}")
