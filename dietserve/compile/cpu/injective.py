"""Element-wise / layout PrimFuncs: everything inlined into one loop nest, parallel outside,
vectorised inside."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir import dlight
from tvm.s_tir.dlight.base.common_schedules import try_inline
from tvm.target import Target

from ...kernels.loops import float_lanes, normalized_schedule, parallelize_and_vectorize


class ParallelInjective(dlight.ScheduleRule):
    """``parallel=False``: the same loop nest, serial (``serial_when_small.py``)."""

    def __init__(self, parallel: bool = True):
        self.parallel = parallel

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        # Analyse: only spatial blocks.
        normalized = normalized_schedule(func, target)
        if normalized is None:
            return None
        sch, infos = normalized
        if not all(info.is_injective() for info in infos):
            return None
        remaining = try_inline(sch, infos)

        # Schedule each remaining loop nest: parallel outer loops, vectorised inner loop.
        lanes = float_lanes(target)
        for info in remaining:
            parallelize_and_vectorize(sch, info.block_rv, lanes, self.parallel)
        return sch
