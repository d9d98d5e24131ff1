"""A tune starts from the cold start's plan: its kernels measured first, each beside the default
rule's kernel on the middle shape of the lengths the plan runs it on, so that a short tune plans
from them rather than from kernels its search happened to draw. Against a synthetic machine (no
build): what is tested is the search's bookkeeping."""

from __future__ import annotations

from pathlib import Path

from dietserve.host.hardware import CPU_PRESETS
from dietserve.kernels.plan.microkernel import MicroKernel
from dietserve.kernels.space.analytic import analytic_plan
from dietserve.kernels.space.cpu import packed_cpu_space
from tuner.database.records import RecordDatabase
from tuner.ops import dense
from tuner.task import ShapeVar, TuningTask
from tuner.tune import TuneOptions, Tuner

from .fake_runner import FakeRunner

HARDWARE = CPU_PRESETS["avx2"]
TARGET = {"kind": "llvm", "num-cores": HARDWARE.cores}


def _cold_plan(task: TuningTask):
    values = [shape["T"] for shape in task.shapes()]
    return analytic_plan(task.spec.func, task.workload, {"var": "T", "values": values}, {}, list(task.weights),
                         TARGET, "", HARDWARE, "fp32")


def test_the_cold_start_kernels_are_measured_first_and_a_short_tune_keeps_them(tmp_path: Path) -> None:
    task = TuningTask.create(dense(768, 768, "bias"), TARGET, ShapeVar("T", range(1, 129)))
    cold = _cold_plan(task)
    seeded = [MicroKernel.from_dict(kernel) for kernel in cold.variants.values()]
    assert len(seeded) >= 2

    def latency(kernel, shape) -> float:  # the cold start's kernels run fastest on this machine
        if kernel is None:
            return 1e-3 * shape["T"]
        return (1e-5 if kernel in seeded else 3e-5) * shape["T"] + 1e-6

    machine = FakeRunner(latency)
    tuner = Tuner(task, packed_cpu_space(HARDWARE), HARDWARE.cores, machine, RecordDatabase(tmp_path / "r.jsonl"),
                  TuneOptions(trials=16, seed=1), hardware=HARDWARE)
    result = tuner.run()
    first = [(machine.kernel(job), job.shapes[0]["T"]) for job in machine.jobs[:4]]
    middles = {name: [row["value"] for row in cold.shapes if row["variant"] == name] for name in cold.variants}
    expected = []
    for name, kernel in zip(cold.variants, seeded, strict=True):
        middle = middles[name][len(middles[name]) // 2]
        expected += [(kernel, middle), (None, middle)]
    assert first == expected[:4]
    # 16 trials: what the search drew besides is slower here, so the plan runs the cold kernels
    assert {result.plan.kernel(row["variant"]) for row in result.plan.shapes} <= set(seeded)

