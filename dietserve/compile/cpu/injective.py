"""Element-wise / layout PrimFuncs: everything inlined into one loop nest, parallel outside,
vectorised inside."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir import dlight
from tvm.s_tir.dlight.base.common_schedules import try_inline
from tvm.target import Target

from .common import float_lanes, normalized_schedule, parallelize_outer, static_extent, vectorize_innermost

# Below this many elements in the innermost loop, fusing it into the parallel loop
# gives threads more work than vectorising it would save.
MIN_VECTOR_EXTENT = 4


class ParallelInjective(dlight.ScheduleRule):
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
            loops = sch.get_loops(info.block_rv)
            if not loops:
                continue
            inner = static_extent(sch, loops[-1])
            if len(loops) == 1 or inner is None or inner < MIN_VECTOR_EXTENT:
                fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
                outer, vec = sch.split(fused, [None, lanes])
                sch.parallel(outer)
                sch.vectorize(vec)
            else:
                vectorize_innermost(sch, info.block_rv, lanes)
                parallelize_outer(sch, info.block_rv, keep_inner=len(sch.get_loops(info.block_rv)) - len(loops) + 1)
        return sch
