"""Element-wise / layout PrimFuncs: everything inlined into one loop nest, parallel outside,
vectorised inside.

A transposing copy (attention's keys, ``[b, s, h, d] -> [b, h, d, s]``) is blocked: vectorised
along the output's contiguous axis, each vector gathers one element from ``lanes`` input rows
that are far apart in memory. Looping over a whole output row per input column would read
every input line once per element, and at long sequences the rows' stride maps those lines to a
few of L1's sets, so every gather would miss L1. Looping over the input's contiguous axis inside
each block of ``lanes`` rows reuses the block's lines from L1 instead.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir import dlight
from tvm.s_tir.dlight.analysis.common_analysis import get_sblockrealize
from tvm.s_tir.dlight.base.common_schedules import try_inline
from tvm.target import Target

from ...kernels.tir.loops import (
    MIN_VECTOR_EXTENT,
    float_lanes,
    loop_extent,
    normalized_schedule,
    parallelize_and_vectorize,
)


class ParallelInjective(dlight.ScheduleRule):
    """``parallel=False``: the same loop nest, serial (``serial_when_small.py``)."""

    def __init__(self, parallel: bool = True):
        self.parallel = parallel

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        inlined = inlined_injective(func, target)
        if inlined is None:
            return None
        sch, remaining = inlined

        # Schedule each remaining loop nest: parallel outer loops, vectorised inner loop.
        lanes = float_lanes(target)
        for info in remaining:
            column = transposed_read_loop(sch, info.block_rv)
            if column is not None:
                block_transpose(sch, info.block_rv, column, lanes, self.parallel)
            else:
                parallelize_and_vectorize(sch, info.block_rv, lanes, self.parallel)
        return sch


def inlined_injective(func: tirx.PrimFunc, target: Target) -> tuple[s_tir.Schedule, list] | None:
    """A schedule of ``func`` with its element-wise blocks inlined into the ones left (their
    infos returned with it), or None where ``func`` is not all spatial blocks."""
    normalized = normalized_schedule(func, target)
    if normalized is None:
        return None
    sch, infos = normalized
    if not all(info.is_injective() for info in infos):
        return None
    return sch, try_inline(sch, infos)


def _vars_in(expr) -> list:
    return list(tirx.analysis.undefined_vars(expr))


def transposed_read_loop(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> s_tir.schedule.LoopRV | None:
    """The loop that runs along an input's contiguous axis, where the block's innermost loop
    (along the output's contiguous axis) reads that input with a stride, and an outer loop is
    left to run in parallel; None for any other loop nest."""
    loops = sch.get_loops(block)
    if len(loops) < 3:
        return None
    inner_extent = loop_extent(sch, loops[-1])
    if inner_extent is not None and inner_extent < MIN_VECTOR_EXTENT:
        return None
    stmt = sch.get(block)
    loop_vars = [sch.get(loop).loop_var for loop in loops]
    bindings = list(zip(stmt.iter_vars, get_sblockrealize(sch, block).iter_values, strict=True))

    def loop_position(var) -> int | None:
        """The loop a block iteration variable is bound to (in the normal form, one loop each)."""
        value = next((value for iter_var, value in bindings if iter_var.var.same_as(var)), None)
        return next((position for position, loop_var in enumerate(loop_vars) if loop_var.same_as(value)), None)

    if len(stmt.writes) != 1:
        return None
    written_last = _vars_in(stmt.writes[0].region[-1].min)
    if len(written_last) != 1 or loop_position(written_last[0]) != len(loops) - 1:
        return None
    inner = written_last[0]
    for read in stmt.reads:
        region = read.region
        if len(region) < 2 or not all(isinstance(r.extent, tirx.IntImm) and int(r.extent) == 1 for r in region):
            continue
        last = [loop_position(var) for var in _vars_in(region[-1].min)]
        strided = any(any(var.same_as(inner) for var in _vars_in(r.min)) for r in region[:-1])
        if strided and len(last) == 1 and last[0] is not None and last[0] != len(loops) - 1:
            return loops[last[0]]
    return None


def block_transpose(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, column: s_tir.schedule.LoopRV,
                    lanes: int, parallel: bool) -> None:
    """Loops (outer..., inner-block, ``column``, lane): outer loops fused and parallel, the
    output's contiguous axis in vectors of ``lanes``, the input's contiguous axis between the
    vector blocks and the lanes. A symbolic tail is peeled off as one predicated vector."""
    loops = sch.get_loops(block)
    column_stmt = sch.get(column)
    outer = [loop for loop in loops[:-1] if not sch.get(loop).same_as(column_stmt)]
    blocks, lane = sch.split(loops[-1], [None, lanes])
    sch.reorder(*outer, blocks, column, lane)
    fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
    if parallel:
        sch.parallel(fused)
    sch.annotate(blocks, "pragma_loop_partition_hint", 1)
    sch.vectorize(lane)
