"""Plan intervals chosen on predictions carried far are raced (``race.race_unmeasured_intervals``).

The search spends its trials where the traffic costs most; the short shapes get few, and the plan
there rests on estimates carried from longer ones. The machine here has a tall tile that runs
at its rate from T = 16 up and pathologically below (as bert-base's 1 x 32-row, 48-column scores
tile did at T = 16), and a one-row tile measured only at T = 1. Without the race the plan sends
T = 2-15 to the tall tile; raced where that rests on predictions, the one-row tile takes them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dietserve.kernels.microkernel import MicroKernel
from tuner.database.records import RecordDatabase
from tuner.dispatch import unmeasured_stretches
from tuner.ops import dense
from tuner.options import TuneOptions
from tuner.race import INTERVAL_RACE_ROUNDS, INTERVAL_RACE_SIZE, STRETCH_RATIO, race_unmeasured_intervals
from tuner.task import ShapeVar, TuningTask
from tuner.tune import Tuner

TARGET = {"kind": "llvm", "num-cores": 2}
TALL = MicroKernel(tile=(("i", (6,)), ("j", (16, 1, 1)), ("k", (1,))), vector=8, pack=16)
SHORT = MicroKernel(tile=(("i", (1,)), ("j", (16, 1, 1)), ("k", (1,))), vector=8, pack=16)


def true_latency(kernel: MicroKernel | None, rows: int) -> float:
    if kernel is None:  # the default kernel: never the best
        return 1e-6 * (5 * rows + 100)
    if kernel == TALL:
        return 1e-6 * rows if rows >= 16 else 50e-6
    return 1e-6 * (2 * rows + 4)


class ShapeMachine:
    """Times every kernel as ``true_latency`` says, in the search and in races alike."""

    device = {"kind": "local"}

    def __init__(self) -> None:
        self.races: list[dict] = []

    def describe(self) -> str:
        return "synthetic"

    def run(self, job: dict) -> dict:
        kernel = None if job["kernel"] is None else MicroKernel.from_json(job["kernel"])
        (shape,) = job["shapes"]
        return {"latencies": {"T": true_latency(kernel, shape["T"])}, "error": None, "build_seconds": 0.0}

    def race(self, job: dict) -> dict:
        self.races.append(job)
        (shape,) = job["shapes"]
        kernels = [None if k is None else MicroKernel.from_json(k) for k in job["kernels"]]
        return {"latencies": [true_latency(k, shape["T"]) for k in kernels], "errors": [None] * len(kernels),
                "error": None, "others_share": 0.0}


def _tuner(machine: ShapeMachine, tmp_path: Path, **options) -> Tuner:
    task = TuningTask.create(dense(768, 768, "bias"), TARGET, ShapeVar("T", range(1, 65)))
    tuner = Tuner(task, [TALL, SHORT], 2, machine, RecordDatabase(tmp_path / "records.jsonl"),
                  TuneOptions(trials=64, max_variants=2, **options))
    for rows in (1, 16, 32, 64):  # as a search weighted by cost would: the long shapes, and T = 1
        shape = {"T": rows}
        tuner.measure_default(shape)
        tuner.measure(SHORT if rows == 1 else TALL, shape)
    return tuner


def _kernel_at(tuner: Tuner, rows: int) -> MicroKernel | None:
    plan = tuner.plan()
    return plan.kernel(next(row["variant"] for row in plan.shapes if row["value"] == rows))


@pytest.mark.parametrize("race", [True, False])
def test_a_choice_resting_on_far_predictions_is_raced_and_corrected(tmp_path: Path, race: bool) -> None:
    machine = ShapeMachine()
    tuner = _tuner(machine, tmp_path, race=race)
    assert _kernel_at(tuner, 6) == TALL  # what the estimates carried from T = 16 say
    trials, records = tuner.trials, (tmp_path / "records.jsonl").read_text()
    summary = race_unmeasured_intervals(tuner)
    if not race:
        assert summary.intervals == 0 and not machine.races and _kernel_at(tuner, 6) == TALL
        return
    # The tall tile's interval reached down to T = 2 from its nearest measurement at 16 (8x):
    # raced in the middle of that stretch on a log scale, beside the plan's next best.
    raced = [job["shapes"][0]["T"] for job in machine.races]
    assert summary.intervals == len(raced) >= 1 and 4 <= raced[0] <= 8
    assert all(len(job["kernels"]) <= INTERVAL_RACE_SIZE and TALL.to_json() in job["kernels"]
               and job["rounds"] == INTERVAL_RACE_ROUNDS for job in machine.races)
    for rows in range(2, 10):
        assert _kernel_at(tuner, rows) == SHORT, rows
    assert _kernel_at(tuner, 32) == TALL
    # Races are no trials and no records.
    assert tuner.trials == trials and (tmp_path / "records.jsonl").read_text() == records


def test_no_interval_race_past_the_time_budget(tmp_path: Path) -> None:
    machine = ShapeMachine()
    tuner = _tuner(machine, tmp_path)
    assert race_unmeasured_intervals(tuner, deadline=time.monotonic()).intervals == 0 and not machine.races
    assert _kernel_at(tuner, 6) == TALL


def test_stretches_are_raced_where_never_measured_or_carried_far() -> None:
    class Plan:
        def __init__(self, rows):
            self.shapes = [{"value": v, "variant": name, "measured": measured, "shape": {"T": v}}
                           for v, name, measured in rows]

    def rows(variant, values, measured=()):
        return [(v, variant, v in measured) for v in values]

    # v0 over 1-40 measured at 20 and 40: its widest stretch, 1-19 (19x), raced near its
    # geometric middle; v1 over 41-50, never measured: raced in its middle; v2 over 51-60,
    # measured at 51: the stretch 52-60 is within the ratio, not raced.
    plan = Plan(rows("v0", range(1, 41), {20, 40}) + rows("v1", range(41, 51)) + rows("v2", range(51, 61), {51}))
    assert 60 / 52 < STRETCH_RATIO
    assert unmeasured_stretches(plan, STRETCH_RATIO) == [("v0", {"T": 4}), ("v1", {"T": 45})]
    assert unmeasured_stretches(Plan(rows("v0", range(1, 9), set(range(1, 9)))), STRETCH_RATIO) == []
