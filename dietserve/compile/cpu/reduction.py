"""Row-wise reductions (layer norm, softmax, pooling sums): one parallel task per row.

All blocks are moved under the parallel row loop so a row is read from cache, not memory,
by each of its passes; element-wise passes are vectorised along the row. A reduction along the
row is split into one partial result per vector lane (``rfactor``), so it runs as vector
instructions and then folds ``lanes`` partials: a scalar running sum waits one add latency per
element (layer norm over 768 took 6x longer that way).
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir import dlight
from tvm.target import Target

from ...kernels.tir.loops import float_lanes, loop_extent, normalized_schedule, vectorize_innermost


def _inline_single_use_spatial(sch: s_tir.Schedule, infos: list) -> list:
    """Inline element-wise blocks read by one block; keep those read twice (softmax's exp)
    materialised per row, so each value is computed once and its loop vectorises."""
    remaining = []
    for info in infos[:-1]:
        if info.is_injective() and len(sch.get_consumers(info.block_rv)) == 1:
            try:
                sch.compute_inline(info.block_rv)
                continue
            except s_tir.ScheduleError:
                pass
        remaining.append(info)
    return [*remaining, infos[-1]]


def _leading_spatial(kinds: str) -> int:
    return len(kinds) - len(kinds.lstrip("S"))


def _split_by_lane(sch: s_tir.Schedule, info, lanes: int) -> s_tir.schedule.SBlockRV | None:
    """``rfactor`` a reduction whose innermost loop runs along the row over a whole number of
    vectors (at least two) into per-lane partials; returns the partials' block, or None."""
    if info.is_injective() or not info.dom_kind().endswith("R"):
        return None
    inner = sch.get_loops(info.block_rv)[-1]
    extent = loop_extent(sch, inner)
    if extent is None or extent % lanes != 0 or extent < 2 * lanes:
        return None
    _, lane = sch.split(inner, [None, lanes])
    return sch.rfactor(lane, len(sch.get_loops(info.block_rv)) - 2)


def _vectorize_partials(sch: s_tir.Schedule, partials: list) -> None:
    """Each partials block, under the row loop as (lane, ..., reduction), becomes a vector
    accumulator: the lane loop innermost and vectorised, its initialisation split off. Every
    block is reordered before any is decomposed (a decomposed block no longer counts as a
    reduction for the next one's checks)."""
    for block in partials:
        lane, *_, reduction = sch.get_loops(block)[1:]
        sch.reorder(reduction, lane)
    for block in partials:
        sch.vectorize(sch.get_loops(block)[-1])
        sch.set_scope(block, 0, "local")
    for block in partials:
        reduction = sch.get_loops(block)[1]
        init = sch.decompose_reduction(block, reduction)
        sch.vectorize(sch.get_loops(init)[-1])


class RowReduction(dlight.ScheduleRule):
    """``parallel=False``: the same loop nest, the rows serial (``serial_when_small.py``)."""

    def __init__(self, parallel: bool = True):
        self.parallel = parallel

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        try:
            return self._schedule(func, target, vector_reductions=True)
        except s_tir.ScheduleError:
            # A reducer rfactor does not know, or a row shape it cannot split: scalar reductions.
            return self._schedule(func, target, vector_reductions=False)

    def _schedule(self, func: tirx.PrimFunc, target: Target, vector_reductions: bool) -> s_tir.Schedule | None:
        # Analyse: some reduction, the last block injective, a shared leading spatial prefix.
        normalized = normalized_schedule(func, target)
        if normalized is None:
            return None
        sch, infos = normalized
        if all(info.is_injective() for info in infos):
            return None
        infos = _inline_single_use_spatial(sch, infos)
        if not infos[-1].is_injective():
            return None
        shared = min(_leading_spatial(info.dom_kind()) for info in infos)
        last_loops = sch.get_loops(infos[-1].block_rv)
        # Keep at least the row's own axis out of the parallel loop.
        shared = min(shared, len(last_loops) - 1)
        if shared < 1:
            return None

        # Schedule: per-lane partial reductions, parallel rows, every pass computed inside the
        # row, vectorised inner loops.
        lanes = float_lanes(target)
        blocks, partials = [], []
        for info in infos[:-1]:
            split = _split_by_lane(sch, info, lanes) if vector_reductions else None
            if split is not None:
                partials.append(split)
                blocks.append(split)
            blocks.append(info.block_rv)
        rows = sch.fuse(*last_loops[:shared]) if shared > 1 else last_loops[0]
        if self.parallel:
            sch.parallel(rows)
        try:
            for block in reversed(blocks):
                sch.compute_at(block, rows, preserve_unit_loops=True)
        except s_tir.ScheduleError:
            if vector_reductions:
                raise
            return None
        _vectorize_partials(sch, partials)
        for info in infos:
            if info.is_injective():
                vectorize_innermost(sch, info.block_rv, lanes)
        return sch
