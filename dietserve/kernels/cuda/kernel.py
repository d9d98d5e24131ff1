"""Apply a CUDA micro-kernel to a matmul-like PrimFunc, for every value of its symbolic dims.

The loop nest (one thread block per ``bm x bn`` output tile, ``bm = tm * ty``, ``bn = tn * tx``):

    blockIdx.z/y/x over batch x ceil(M / bm) x ceil(N / bn), threadIdx.y/x over ty x tx:
        acc[tm, tn] = 0                                                      (registers)
        for each reduction step of bk:
            A_shared[bm, bk], B_shared[bk, bn] <- global, zero-padded, by all threads  <- checks
            for k in bk: for tm x tn: acc += A_shared * B_shared                        <- none
        write acc's real rows/columns back through the epilogue (bias, GELU)            <- checks

Local padding (DietCode): ``pad_einsum`` pads the iteration space to whole block tiles; the padded
operands become shared-memory tiles filled at each reduction step (``set_scope`` + ``compute_at``)
and the padded result becomes the thread's register tile, so padding never costs a padded copy
of a whole tensor and the FMA loop is the same straight-line code for every shape.
"""

from __future__ import annotations

from tvm import s_tir, tirx

from ..plan.microkernel import MicroKernel
from ..tir.loops import loops_below, static_extent
from ..tir.matching import ScheduleMismatch, find_matmul, pad_to_tiles, stage_result

__all__ = ["ScheduleMismatch", "apply_cuda", "fill_tile", "vector_lanes"]

_OPERAND_SCOPES = ("shared", "shared.dyn")


def vector_lanes(source, staged, lanes: int) -> int:
    """Lanes a global load of ``source`` into its (padded) copy ``staged`` may use.

    The rows of ``source`` must be a static multiple of ``lanes``, so that every vector is
    aligned whatever the symbolic dims (a float4 load from a row of length T faults at runtime),
    and its innermost axis must be unpadded, so the padding check does not vary across lanes.
    """
    inner, staged_inner = static_extent(source.shape[-1]), static_extent(staged.shape[-1])
    if lanes > 1 and inner is not None and inner == staged_inner and inner % lanes == 0:
        return lanes
    return 1


def operand_stage(sch: s_tir.Schedule, block, index: int, scope: str):
    """(the block that stages the product's operand ``index`` in ``scope``, the buffer the product
    reads): the padded copy ``pad_to_tiles`` made (zeros past the real extent), else a plain
    copy."""
    staged = sch.get(block).reads[index].source
    pads = [p for p in sch.get_producers(block) if sch.get(p).writes[0].source.same_as(staged)]
    if pads:
        sch.set_scope(pads[0], 0, scope)
        return pads[0], staged
    return sch.cache_read(block, index, scope), staged


def fill_tile(sch: s_tir.Schedule, block, at, threads: tuple[int, int], lanes: int) -> None:
    """A shared-memory tile filled cooperatively by the block's threads at reduction step ``at``."""
    sch.compute_at(block, at, preserve_unit_loops=True)
    loops = loops_below(sch, block, at)
    inner = static_extent(sch.get(loops[-1]).extent)
    if inner is None or inner % lanes:
        lanes = 1
    _, y, x, vec = sch.split(sch.fuse(*loops), [None, threads[0], threads[1], lanes])
    sch.bind(y, "threadIdx.y")
    sch.bind(x, "threadIdx.x")
    if lanes > 1:
        sch.vectorize(vec)


def apply_cuda(func: tirx.PrimFunc, kernel: MicroKernel, loop_partition: bool = False) -> tirx.PrimFunc:
    """Schedule ``func`` (symbolic) with ``kernel``; raises ScheduleMismatch if it does not fit."""
    # Analyse: a CUDA micro-kernel and one matmul-like reduction to apply it to.
    try:
        (tm, ty), (tn, tx), (bk,) = (kernel.tile_sizes(axis) for axis in ("i", "j", "k"))
    except (KeyError, ValueError) as err:
        raise ScheduleMismatch(f"not a CUDA micro-kernel (i=tm x ty, j=tn x tx, k=bk): {kernel}") from err
    operand_scope = kernel.cache_scopes[0] if kernel.cache_scopes else ""
    if operand_scope not in _OPERAND_SCOPES:
        raise ScheduleMismatch(f"CUDA operand tiles live in one of {_OPERAND_SCOPES}, not {operand_scope!r}")
    sch = s_tir.Schedule(func)
    block, epilogue = find_matmul(sch)
    operands = [region.source for region in sch.get(block).reads]
    if len(operands) != 2:
        raise ScheduleMismatch(f"expected a product of two operands, the reduction reads {len(operands)}")
    # Pad to whole block tiles; the padded operands and result are staged below, never whole.
    padded, epilogue = pad_to_tiles(sch, block, epilogue, (tm * ty, tn * tx, bk))

    # Schedule: block tile -> thread grid -> register tile; k split at the shared-memory step.
    *batch, i, j, k = sch.get_loops(block)
    i_tile, i_thread, i_reg = sch.split(i, [None, ty, tm])
    j_tile, j_thread, j_reg = sch.split(j, [None, tx, tn])
    k_step, k_inner = sch.split(k, [None, bk])
    sch.reorder(*batch, i_tile, j_tile, i_thread, j_thread, k_step, k_inner, i_reg, j_reg)
    if batch:
        sch.bind(sch.fuse(*batch) if len(batch) > 1 else batch[0], "blockIdx.z")
    sch.bind(i_tile, "blockIdx.y")
    sch.bind(j_tile, "blockIdx.x")
    sch.bind(i_thread, "threadIdx.y")
    sch.bind(j_thread, "threadIdx.x")
    if kernel.unroll:
        outermost = sch.get_loops(block)[0]
        sch.annotate(outermost, "pragma_auto_unroll_max_step", kernel.unroll)
        sch.annotate(outermost, "pragma_unroll_explicit", 1)

    # The accumulator is the thread's tm x tn register tile; the epilogue writes real elements only.
    stage_result(sch, block, epilogue, padded, j_thread)

    # Operand tiles in shared memory, refilled by all threads at every reduction step.
    for index, operand in enumerate(operands):
        stage, staged = operand_stage(sch, block, index, operand_scope)
        fill_tile(sch, stage, k_step, (ty, tx), vector_lanes(operand, staged, kernel.vector))

    sch.decompose_reduction(block, k_step)
    if loop_partition:
        # Whole reduction steps then the ragged last one: the fills of the former lose their k
        # checks. TVM 0.27's LoopPartition fails on a hint at the fill loops themselves and, with
        # an int32/int64 mismatch, on a static int64 reduction; so only symbolic ones are split.
        # The write-back loop is not hinted: its bound depends on threadIdx.y, and TVM 0.27
        # partitions it wrongly (wrong rows, reads before the register tile, illegal
        # addresses for dense layers at every ragged T).
        if static_extent(sch.get(k_step).extent) is None:
            sch.annotate(k_step, "pragma_loop_partition_hint", 1)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)
