"""The CPU GEMM micro-kernel on packed weights: the loop nest of a BLAS sgemm, for every T.

The operator reads its weight as ``Wp[N / P, K, P]`` (``packing.py``), so one register tile
streams a contiguous panel. The loop nest (``joo`` a block of panels sized for L2, ``io`` a tile
of ``mr`` rows):

    parallel over (joo, io):                 a task: mr rows x nb panels; panels stay in L2
        for jom in panel groups of pk:       the register tile: mr x (pk * P) accumulators
            for k in K:                      A broadcast, pk*P/lanes B vector loads, FMAs
                for jok, ii, ji: C[ii, jok*P + ji] += A[ii, k] * Wp[jok, k, ji]
            epilogue (bias, GELU, residual) on the register tile, stored once

A symbolic row count is padded to whole ``mr`` tiles (one padded copy of the activations,
parallel), so the inner loop is the same straight-line code for every T; ``mr = 1`` tiles need
no padding at all (the small-T regime: one pass over the weights, panels split across cores).
"""

from __future__ import annotations

from tvm import s_tir, tirx

from .loops import parallelize_and_vectorize, vectorize_tile
from .matching import ScheduleMismatch, find_matmul, pad_to_tiles, stage_result
from .microkernel import MicroKernel


def packed_tile(kernel: MicroKernel) -> tuple[int, int, int, int]:
    """(mr, panel, panels per register tile, panels per task) of a packed micro-kernel."""
    (mr,) = kernel.tile_sizes("i")
    panel, pk, groups = kernel.tile_sizes("j")
    return mr, panel, pk, pk * groups


def apply_cpu_packed(func: tirx.PrimFunc, kernel: MicroKernel) -> tirx.PrimFunc:
    """Schedule ``func`` (already reading its weight packed, ``pack_prim_func``) with ``kernel``."""
    mr, panel, pk, nb = packed_tile(kernel)
    lanes = kernel.vector
    if panel % lanes:
        raise ScheduleMismatch(f"panel width {panel} is not a whole number of {lanes}-lane vectors")
    sch = s_tir.Schedule(func)
    block, epilogue = find_matmul(sch)
    loops = sch.get_loops(block)
    if len(loops) != 4:
        raise ScheduleMismatch("expected a packed dense layer: rows, panels, panel columns, reduction")
    columns = loops[1]
    panels = sch.get(columns).extent
    if int(sch.get(loops[2]).extent) != panel or not isinstance(panels, tirx.IntImm) or int(panels) % nb:
        raise ScheduleMismatch(f"weight packing does not fit {nb} panels of {panel} per task")
    padded, epilogue = pad_to_tiles(sch, block, epilogue, (mr, 1, 1, 1))
    producers = sch.get_producers(block) if padded else []

    i, jo, ji, k = sch.get_loops(block)
    io, ii = sch.split(i, [None, mr])
    joo, jom, jok = sch.split(jo, [None, nb // pk, pk])
    depth = int(sch.get(k).extent)
    kc = kernel.tile_sizes("k")[0]
    if 1 < kc < depth:
        if depth % kc:
            raise ScheduleMismatch(f"reduction of {depth} is not a whole number of {kc}-deep blocks")
        # BLIS order: a kc-deep block of the task's panels stays in L2 while every row tile
        # passes over it; the task's partial sums (rows x panels) live in its local workspace.
        ko, k = sch.split(k, [None, kc])
        sch.reorder(joo, ko, io, jom, k, jok, ii, ji)
        writer, separate_epilogue = stage_result(sch, block, epilogue, padded, joo)
        task, reduce_at = joo, ko
    else:
        sch.reorder(joo, io, jom, k, jok, ii, ji)
        writer, separate_epilogue = stage_result(sch, block, epilogue, padded, jom)
        task, reduce_at = sch.fuse(joo, io), k
    if kernel.threads != 1:
        sch.parallel(task)  # before decompose_reduction: after it the dataflow is not compact
    vectors, lane = sch.split(ji, [None, lanes])
    sch.vectorize(lane)
    sch.unroll(vectors)
    sch.unroll(ii)
    sch.unroll(jok)
    init = sch.decompose_reduction(block, reduce_at)
    init_loops = sch.get_loops(init)
    vectorize_tile(sch, init_loops[-1], lanes)
    for loop in init_loops[-4:-1]:
        sch.unroll(loop)
    for stage in (writer, separate_epilogue):
        if stage is not None:
            vectorize_tile(sch, sch.get_loops(stage)[-1], lanes)
    for producer in producers:
        parallelize_and_vectorize(sch, producer, lanes)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)
