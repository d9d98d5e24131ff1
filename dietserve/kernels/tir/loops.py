"""Loop-level helpers every CPU schedule shares (the default rules and the micro-kernels)."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import SBlockInfo, normalize_prim_func
from tvm.target import Target
from tvm.target.codegen import llvm_cpu_has_features


def float_lanes(target: Target) -> int:
    """fp32 lanes of the widest vector register the target has (8 on AVX2, 16 on AVX-512).

    Asked of the CPU's features: LLVM reports a vector width of 512 for every x86 CPU.
    """
    if llvm_cpu_has_features("avx512f", target):
        return 16
    if llvm_cpu_has_features("avx", target):
        return 8
    return 4


def static_extent(expr) -> int | None:
    """The value of a constant extent, None for a symbolic one."""
    return int(expr) if isinstance(expr, tirx.IntImm) else None


def loop_extent(sch: s_tir.Schedule, loop: s_tir.schedule.LoopRV) -> int | None:
    return static_extent(sch.get(loop).extent)


def is_llvm(target: Target) -> bool:
    return target.kind.name == "llvm"


def vectorize_tile(sch: s_tir.Schedule, loop: s_tir.schedule.LoopRV, lanes: int) -> None:
    """A static register-tile loop: whole vectors, the vector count unrolled (vectorising a
    multi-vector loop directly makes LLVM spill to the stack); left alone when symbolic."""
    extent = loop_extent(sch, loop)
    if extent is None:
        return
    if extent > lanes and extent % lanes == 0:
        outer, vec = sch.split(loop, [None, lanes])
        sch.vectorize(vec)
        sch.unroll(outer)
    elif extent <= 4 * lanes:
        sch.vectorize(loop)


def vectorize_innermost(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int) -> None:
    """Vectorise a block's innermost loop in whole vectors where its extent allows."""
    loops = sch.get_loops(block)
    if not loops:
        return
    inner = loops[-1]
    extent = loop_extent(sch, inner)
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


# Below this many elements in the innermost loop, fusing it into the parallel loop gives
# threads more work than vectorising it would save.
MIN_VECTOR_EXTENT = 4


def parallelize_and_vectorize(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int,
                              parallel: bool = True) -> None:
    """An element-wise or copy loop nest: outer loops fused and parallel (serial where
    ``parallel`` is False), innermost vectorised."""
    loops = sch.get_loops(block)
    if not loops:
        return
    inner = loop_extent(sch, loops[-1])
    if len(loops) == 1 or (inner is not None and inner < MIN_VECTOR_EXTENT):
        fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
        outer, vec = sch.split(fused, [None, lanes])
        if parallel:
            sch.parallel(outer)
        sch.vectorize(vec)
        return
    vectorize_innermost(sch, block, lanes)
    outer = loops[:-1]
    fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
    if parallel:
        sch.parallel(fused)


def normalized_schedule(func: tirx.PrimFunc, target: Target) -> tuple[s_tir.Schedule, list[SBlockInfo]] | None:
    """Every CPU rule's first step: an llvm PrimFunc whose blocks are in normal form, or None."""
    if not isinstance(func, tirx.PrimFunc) or not is_llvm(target):
        return None
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    return None if infos is None else (sch, infos)


def loops_below(sch: s_tir.Schedule, block, at) -> list:
    """``block``'s loops nested inside loop ``at``."""
    loops = sch.get_loops(block)
    anchor = sch.get(at)
    for depth, loop in enumerate(loops):
        if sch.get(loop).same_as(anchor):
            return list(loops[depth + 1 :])
    return list(loops)
