"""Small helpers shared by the CPU schedule rules."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import SBlockInfo, normalize_prim_func
from tvm.target import Target
from tvm.target.codegen import llvm_cpu_has_features


def float_lanes(target: Target) -> int:
    """fp32 lanes of the widest vector register the target has (8 on AVX2, 16 on AVX-512).

    Asked of the CPU's features: LLVM's reported vector width is 512 for every x86 CPU here.
    """
    if llvm_cpu_has_features("avx512f", target):
        return 16
    if llvm_cpu_has_features("avx", target):
        return 8
    return 4


def static_extent(sch: s_tir.Schedule, loop: s_tir.schedule.LoopRV) -> int | None:
    extent = sch.get(loop).extent
    return int(extent) if isinstance(extent, tirx.IntImm) else None


def is_llvm(target: Target) -> bool:
    return target.kind.name == "llvm"


def vectorize_innermost(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int) -> None:
    """Vectorise a block's innermost loop in whole vectors where its extent allows."""
    loops = sch.get_loops(block)
    if not loops:
        return
    inner = loops[-1]
    extent = static_extent(sch, inner)
    if extent is None:
        # Symbolic: partitioning peels the one predicated tail vector off a check-free loop.
        outer, vec = sch.split(inner, [None, lanes])
        sch.annotate(outer, "pragma_loop_partition_hint", 1)
        sch.vectorize(vec)
    elif extent % lanes == 0 and extent > lanes:
        _, vec = sch.split(inner, [None, lanes])
        sch.vectorize(vec)
    elif extent > 1 and extent <= 4 * lanes:
        sch.vectorize(inner)


def parallelize_outer(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, keep_inner: int) -> None:
    """Fuse all but the ``keep_inner`` innermost loops of a block and run them in parallel."""
    loops = sch.get_loops(block)
    outer = loops[: len(loops) - keep_inner]
    if not outer:
        return
    fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
    sch.parallel(fused)


def parallelize_copy(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int) -> None:
    """A copy/pad block: outer loops fused and parallel, the innermost loop vectorised."""
    loops = sch.get_loops(block)
    if len(loops) > 1:
        vectorize_innermost(sch, block, lanes)
        outer = loops[:-1]
        sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
    else:
        outer, vec = sch.split(loops[0], [None, lanes])
        sch.parallel(outer)
        sch.vectorize(vec)


def normalized_schedule(func: tirx.PrimFunc, target: Target) -> tuple[s_tir.Schedule, list[SBlockInfo]] | None:
    """Every CPU rule's first step: an llvm PrimFunc whose blocks are in normal form, or None."""
    if not isinstance(func, tirx.PrimFunc) or not is_llvm(target):
        return None
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    return None if infos is None else (sch, infos)
