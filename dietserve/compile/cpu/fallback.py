"""Last resort: run the outer spatial loops of every block in parallel."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir import dlight
from tvm.target import Target

from ...kernels.tir.loops import normalized_schedule


class ParallelFallback(dlight.ScheduleRule):
    """``parallel=False``: the blocks left as they are, serial (``serial_when_small.py``)."""

    def __init__(self, parallel: bool = True):
        self.parallel = parallel

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        normalized = normalized_schedule(func, target)
        if normalized is None:
            return None
        sch, infos = normalized
        for info in infos:
            kinds = info.dom_kind()
            spatial = len(kinds) - len(kinds.lstrip("S"))
            loops = sch.get_loops(info.block_rv)[:spatial]
            if loops and self.parallel:
                sch.parallel(sch.fuse(*loops) if len(loops) > 1 else loops[0])
        return sch
