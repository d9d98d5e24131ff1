"""Row-wise reductions (layer norm, softmax, pooling sums): one parallel task per row.

All blocks are moved under the parallel row loop so a row is read from cache, not memory,
by each of its passes; element-wise passes are vectorised along the row.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir import dlight
from tvm.target import Target

from ...kernels.loops import float_lanes, normalized_schedule, vectorize_innermost


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


class RowReduction(dlight.ScheduleRule):
    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
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

        # Schedule: parallel rows, every pass computed inside the row, vectorised inner loops.
        lanes = float_lanes(target)
        rows = sch.fuse(*last_loops[:shared]) if shared > 1 else last_loops[0]
        sch.parallel(rows)
        try:
            for info in reversed(infos[:-1]):
                sch.compute_at(info.block_rv, rows, preserve_unit_loops=True)
        except s_tir.ScheduleError:
            return None
        for info in infos:
            if info.is_injective():
                vectorize_innermost(sch, info.block_rv, lanes)
        return sch
