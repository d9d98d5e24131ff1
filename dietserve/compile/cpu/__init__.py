"""Default CPU schedules for every PrimFunc the tuner does not cover: none left serial.

Rules follow dlight's interface (``apply(func, target, tunable) -> Schedule | None``) and are
tried in order, the fallback last.
"""

from tvm.s_tir import dlight

from ...kernels.default_cpu import CPUMatmul
from .fallback import ParallelFallback
from .injective import ParallelInjective
from .reduction import RowReduction


def cpu_schedule_rules() -> list[dlight.ScheduleRule]:
    return [CPUMatmul(), RowReduction(), ParallelInjective(), ParallelFallback()]


__all__ = ["CPUMatmul", "ParallelFallback", "ParallelInjective", "RowReduction", "cpu_schedule_rules"]
