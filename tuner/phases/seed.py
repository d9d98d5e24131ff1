"""Seed: the cold start's plan (``kernels/space/analytic.py``, priced from the hardware model)
measured first, each of its kernels on the middle shape of the lengths it runs, then the default
rule's kernel there (the plan's guard compares them). A tune replaces that plan; measured, its
kernels are candidates of the tune's own plan and seeds of its search, so a short tune starts
from what is served before it rather than from kernels it happened to draw."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from dietserve.host.hardware import CpuHardware
from dietserve.kernels.plan.microkernel import MicroKernel
from dietserve.kernels.space.analytic import analytic_plan

from . import BatchPhase, Probe

if TYPE_CHECKING:
    from ..tune import Tuner


class Seed(BatchPhase):
    def batches(self, tuner: Tuner, until: int) -> Iterator[list[Probe]]:
        if not isinstance(tuner.hardware, CpuHardware):
            return  # the hardware model prices CPU kernels only
        task, var = tuner.task, tuner.task.varying()
        plan = analytic_plan(task.spec.func, task.workload, {"var": var, "values": [s[var] for s in tuner.shapes]},
                             task.fixed, tuner.weights, task.target, "", tuner.hardware, task.spec.precision)
        if plan is None:
            return
        probes = []
        for name, kernel in plan.variants.items():
            rows = [row["shape"] for row in plan.shapes if row["variant"] == name]
            kernel = MicroKernel.from_dict(kernel)
            if rows and kernel in tuner.space:
                shape = rows[len(rows) // 2]
                probes += [Probe(kernel, shape), Probe(None, shape)]
        yield probes
