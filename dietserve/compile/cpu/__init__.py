"""Default CPU schedules for every PrimFunc the tuner does not cover: none left serial (a small
shape takes a serial copy of the row-wise and element-wise loop nests: ``serial_when_small.py``).

Rules follow dlight's interface (``apply(func, target, tunable) -> Schedule | None``) and are
tried in order, the fallback last.
"""

from tvm.s_tir import dlight

from ...kernels.cpu_default.rule import CPUMatmul
from .fallback import ParallelFallback
from .injective import ParallelInjective
from .reduction import RowReduction


def cpu_schedule_rules(parallel: bool = True) -> list[dlight.ScheduleRule]:
    """The rules in order; ``parallel=False``: the row-wise, element-wise and fallback rules'
    loop nests left serial (``serial_when_small.py``; the matmul rule's are always parallel)."""
    return [CPUMatmul(), RowReduction(parallel), ParallelInjective(parallel), ParallelFallback(parallel)]


__all__ = ["CPUMatmul", "ParallelFallback", "ParallelInjective", "RowReduction", "cpu_schedule_rules"]
