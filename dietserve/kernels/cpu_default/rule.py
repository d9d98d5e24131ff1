"""Register-tiled CPU schedule for matmul-like PrimFuncs with fused element-wise epilogues.

Covers the dense layers ``[T, K] x [K, N] (+ bias, GELU, residual)`` and both attention
batch-matmuls. Each parallel task computes an ``mr x nr`` output tile in registers over the
whole reduction, then applies the epilogue while writing the tile back. Symbolic row or column
counts are padded up to whole tiles first, so the tile loop carries no bound checks and the
accumulator is a fixed-size block LLVM keeps in registers.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir import dlight
from tvm.target import Target

from ..tir.loops import float_lanes, is_llvm, loop_extent, parallelize_and_vectorize, vectorize_tile
from ..tir.matching import ScheduleMismatch, find_matmul, is_multiply_accumulate, pad_to_tiles

# Accumulator registers a tile may use; both AVX2 (16) and AVX-512 (32) keep a few spare.
ACCUMULATOR_VECTORS = 12


def choose_tile(rows: int | None, cols: int | None, lanes: int) -> tuple[int, int]:
    """Pick ``(mr, nr)``: two vectors wide where the column count allows, rows filling the rest."""
    if cols is not None and cols % (2 * lanes) != 0 and cols % lanes == 0:
        nr = lanes
    elif cols is not None and cols < lanes:
        nr = cols
    else:
        nr = 2 * lanes
    mr = max(1, ACCUMULATOR_VECTORS // max(1, nr // lanes))
    if rows is not None:
        mr = min(mr, rows)
    return mr, nr


class CPUMatmul(dlight.ScheduleRule):
    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        # Analyse: one multiply-accumulate reduction, element-wise producers and epilogue
        # folded in (the tuner's matcher: the same operators its micro-kernels replace).
        if not is_llvm(target) or not isinstance(func, tirx.PrimFunc):
            return None
        sch = s_tir.Schedule(func)
        try:
            block, epilogue = find_matmul(sch)
        except ScheduleMismatch:
            return None
        if not is_multiply_accumulate(sch.get(block)):
            return None

        # Schedule: pad to whole tiles, tile, keep each tile in registers, parallel tiles.
        lanes = float_lanes(target)
        *_, i, j, _ = sch.get_loops(block)
        rows, cols = loop_extent(sch, i), loop_extent(sch, j)
        mr, nr = choose_tile(rows, cols, lanes)
        # Pad the rows and columns to whole tiles so the register tile carries no bound checks.
        # Unlike the micro-kernels' local padding, the padded inputs are whole buffers here (cheap
        # next to the matmul, except for attention's seq x seq operand), copied in parallel.
        try:
            padded, epilogue = pad_to_tiles(sch, block, epilogue, (mr, nr, 1))
        except ScheduleMismatch:
            return None  # not an einsum: tiles could not be padded, so not ours
        if padded:
            for producer in sch.get_producers(block):
                parallelize_and_vectorize(sch, producer, lanes)
        *batch, i, j, k = sch.get_loops(block)
        i_outer, i_inner = sch.split(i, [None, mr])
        j_outer, j_inner = sch.split(j, [None, nr])
        sch.reorder(i_outer, j_outer, k, i_inner, j_inner)
        tiles = sch.fuse(*batch, i_outer, j_outer)
        sch.parallel(tiles)
        accumulator = sch.cache_write(block, 0, "local")
        sch.reverse_compute_at(accumulator, tiles, preserve_unit_loops=True)
        writers = [accumulator]
        if epilogue is not None:
            try:
                sch.reverse_compute_inline(epilogue)
            except s_tir.ScheduleError:
                sch.reverse_compute_at(epilogue, tiles, preserve_unit_loops=True)
                writers.append(epilogue)
        vectorize_tile(sch, j_inner, lanes)
        sch.unroll(i_inner)
        sch.decompose_reduction(block, k)
        for writer in writers:
            vectorize_tile(sch, sch.get_loops(writer)[-1], lanes)
        return sch
