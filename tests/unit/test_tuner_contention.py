"""A search trial timed while other work took the CPUs (``tune.Tuner._run_job``): timed once more,
not counted twice, the quieter timing kept. Against a synthetic machine that says how busy each
timing was (no build): what is tested is the bookkeeping; ``test_host_load.py`` tests the
reading itself and ``test_tuner_race.py`` a real worker's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dietserve.kernels.microkernel import MicroKernel
from tuner.database.records import RecordDatabase
from tuner.dispatch import shape_key
from tuner.measure.host_load import CONTENDED_SHARE
from tuner.ops import dense
from tuner.options import TuneOptions
from tuner.task import ShapeVar, TuningTask
from tuner.tune import Tuner

KERNEL = MicroKernel(tile=(("i", (6,)), ("j", (16, 1, 1)), ("k", (1,))), vector=8, pack=16)


class BusyMachine:
    """Each timing reads ``latency x (1 + busy)`` and reports ``busy`` as the share other work
    took, ``busy`` taken in turn from the list given (then 0)."""

    def __init__(self, busy: list[float | None]) -> None:
        self.busy = list(busy)
        self.jobs: list[dict] = []

    def describe(self) -> str:
        return "synthetic, busy at times"

    def run(self, job: dict) -> dict:
        self.jobs.append(job)
        busy = self.busy.pop(0) if self.busy else 0.0
        return {"latencies": {"T": 1e-3 * (1 + (busy or 0.0))}, "error": None, "build_seconds": 0.0,
                "others_share": busy}


def _measured(busy: list[float | None], tmp_path: Path) -> tuple[Tuner, BusyMachine, dict]:
    machine = BusyMachine(busy)
    task = TuningTask.create(dense(768, 768, "bias"), {"kind": "llvm", "num-cores": 2}, ShapeVar("T", (64,)))
    database = RecordDatabase(tmp_path / "records.jsonl")
    tuner = Tuner(task, [KERNEL], 2, machine, database, TuneOptions(trials=8))
    tuner.measure(KERNEL, {"T": 64})
    (record,) = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    return tuner, machine, record


@pytest.mark.parametrize(("busy", "timings", "kept"), [
    ([0.5, 0.0], 2, 0.0),  # busy, then quiet: the quiet one
    ([0.5, 0.7], 2, 0.5),  # busier the second time: the first
    ([CONTENDED_SHARE / 2], 1, CONTENDED_SHARE / 2),  # quiet enough: timed once
    ([None], 1, None),  # the machine does not say (RPC, a GPU): timed once
])
def test_a_trial_timed_beside_other_work_is_timed_again_and_the_quieter_kept(
        busy: list, timings: int, kept: float | None, tmp_path: Path) -> None:
    tuner, machine, record = _measured(busy, tmp_path)
    assert len(machine.jobs) == timings and tuner.trials == 1 and tuner.retimed == timings - 1
    assert tuner.measured[shape_key({"T": 64})][KERNEL] == pytest.approx(1e-3 * (1 + (kept or 0.0)))
    assert record["latency_s"] == pytest.approx(1e-3 * (1 + (kept or 0.0)))
    assert record["meta"]["others_share"] == kept
    assert tuner.plan().provenance["retimed"] == timings - 1
