"""Element-wise / layout PrimFuncs: everything inlined into one loop nest, parallel outside,
vectorised inside; a transpose is moved through a small register-sized tile instead."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir import dlight
from tvm.s_tir.dlight.base.common_schedules import try_inline
from tvm.target import Target

from ...kernels.loops import float_lanes, loop_extent, loops_below, normalized_schedule, parallelize_and_vectorize


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
            axis = transposed_axis(sch, info.block_rv, lanes)
            if axis is None:
                parallelize_and_vectorize(sch, info.block_rv, lanes)
            else:
                stage_transpose(sch, info.block_rv, axis, lanes)
        return sch


def transposed_axis(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int) -> int | None:
    """The loop that walks the contiguous (last) axis of the block's one input, when that is
    not the innermost loop: a transpose, whose vectorised innermost loop would gather a column
    (attention's K^T: one element from each 9 KB row of the QKV output). None otherwise, and
    where that loop's extent is not a static multiple of ``lanes``."""
    stmt = sch.get(block)
    loops = sch.get_loops(block)
    iter_vars = [iv.var for iv in stmt.iter_vars]
    if len(stmt.reads) != 1 or len(loops) < 2 or len(iter_vars) != len(loops):
        return None
    region = stmt.reads[0].region
    contiguous = tirx.analysis.undefined_vars(region[-1].min)
    if len(contiguous) != 1 or not any(contiguous[0].same_as(v) for v in iter_vars[:-1]):
        return None
    if not any(iter_vars[-1].same_as(v) for r in region[:-1] for v in tirx.analysis.undefined_vars(r.min)):
        return None
    axis = next(i for i, v in enumerate(iter_vars) if contiguous[0].same_as(v))
    extent = loop_extent(sch, loops[axis])
    return axis if extent is not None and extent % lanes == 0 else None


def stage_transpose(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, axis: int, lanes: int) -> None:
    """``lanes x lanes`` tiles: each read as whole vectors along the input's contiguous axis
    into a local tile, then written as whole vectors along the output's. On 2 cores, bert-base's
    K^T at seq 512 took 168 us against 336 when gathered column by column, and the plain
    blocked loop (no local tile) 290: output rows 2 KB apart all fall in two L1 sets."""
    loops = sch.get_loops(block)
    inner_out, inner_in = loops[-1], loops[axis]
    out_outer, out_vec = sch.split(inner_out, [None, lanes])
    in_outer, in_rows = sch.split(inner_in, [None, lanes])
    others = [loop for i, loop in enumerate(loops) if i not in (axis, len(loops) - 1)]
    sch.reorder(*others, out_outer, in_outer, in_rows, out_vec)
    sch.parallel(sch.fuse(*others, out_outer) if others else out_outer)
    tile = sch.cache_read(block, 0, "local")
    sch.compute_at(tile, in_outer)
    *_, tile_rows, tile_vec = loops_below(sch, tile, in_outer)
    sch.unroll(tile_rows)
    sch.vectorize(tile_vec)
    sch.unroll(in_rows)
    sch.vectorize(out_vec)
