"""Last resort: run the outer spatial loops of every block in parallel."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir import dlight
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.target import Target

from .common import is_llvm


class ParallelFallback(dlight.ScheduleRule):
    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not is_llvm(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if infos is None:
            return None
        for info in infos:
            kinds = info.dom_kind()
            spatial = len(kinds) - len(kinds.lstrip("S"))
            loops = sch.get_loops(info.block_rv)[:spatial]
            if loops:
                sch.parallel(sch.fuse(*loops) if len(loops) > 1 else loops[0])
        return sch
