"""Apply a CPU micro-kernel to a matmul-like PrimFunc, for every value of its symbolic dims.

The loop nest (DietCode's micro-kernel, BLIS's blocking):

    parallel over tiles (batch x ceil(M / mc) x ceil(N / nc)):
        for each reduction step of kc:
            pack A[mc, kc] (and optionally B[kc, nc]) into a local buffer, zero-padded   <- checks
            for each mr x nr register tile: for k in kc: C_local += A * B               <- none
        write C_local's real rows/columns back through the epilogue (bias, GELU)         <- checks

Local padding: ``pad_einsum`` pads the iteration space to whole tiles, then the padded operand
and result buffers are made local to the tile (``set_scope`` + ``compute_at``), so the padding
lives only in the tile's workspace, never as padded copies of whole tensors, and the inner loop
is the same straight-line code for every shape. ``loop_partition`` additionally splits the
packing loops into a check-free body and a tail.
"""

from __future__ import annotations

from tvm import s_tir, tirx

from ..plan.microkernel import MicroKernel
from ..tir.loops import loops_below, vectorize_tile
from ..tir.matching import find_matmul, pad_to_tiles, stage_result


def _pack(sch: s_tir.Schedule, block, at, lanes: int, loop_partition: bool) -> None:
    """A packing copy computed inside the tile: innermost loop vectorised when static."""
    sch.compute_at(block, at, preserve_unit_loops=True)
    sch.set_scope(block, 0, "local")
    own = loops_below(sch, block, at)
    if own:
        vectorize_tile(sch, own[-1], lanes)
        if loop_partition and len(own) > 1:
            sch.annotate(own[0], "pragma_loop_partition_hint", 1)


def apply_cpu(func: tirx.PrimFunc, kernel: MicroKernel, loop_partition: bool = False) -> tirx.PrimFunc:
    """Schedule ``func`` (symbolic) with ``kernel``; raises ScheduleMismatch if it does not fit."""
    (mr, ti), (nr, tj), (kc,) = (kernel.tile_sizes(axis) for axis in ("i", "j", "k"))
    lanes = kernel.vector
    pack_b = "B.local" in kernel.cache_scopes
    sch = s_tir.Schedule(func)
    block, epilogue = find_matmul(sch)
    padded, epilogue = pad_to_tiles(sch, block, epilogue, (mr * ti, nr * tj, kc))
    producers = sch.get_producers(block) if padded else []

    *batch, i, j, k = sch.get_loops(block)
    i_tile, i_micro, i_reg = sch.split(i, [None, ti, mr])
    j_tile, j_micro, j_reg = sch.split(j, [None, tj, nr])
    sch.reorder(i_tile, j_tile, j_micro, i_micro, k, i_reg, j_reg)
    tile = sch.fuse(*batch, i_tile, j_tile)
    if kernel.threads != 1:
        sch.parallel(tile)
    if kernel.unroll:
        sch.annotate(tile, "pragma_auto_unroll_max_step", kernel.unroll)
        sch.annotate(tile, "pragma_unroll_explicit", 1)

    # The padded result lives only in the tile's workspace; each mr x nr register tile
    # accumulates the whole reduction in registers before it is stored there.
    writer, separate_epilogue = stage_result(sch, block, epilogue, padded, tile)
    if separate_epilogue is not None:
        vectorize_tile(sch, sch.get_loops(separate_epilogue)[-1], lanes)
    registers = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(registers, i_micro, preserve_unit_loops=True)
    vectorize_tile(sch, sch.get_loops(registers)[-1], lanes)

    # Operand panels: padded ones are packed per tile; B optionally even if not padded.
    for producer in producers:
        _pack(sch, producer, tile, lanes, loop_partition)
    if pack_b and not any(_writes_operand(sch, producer, block, 1) for producer in producers):
        packed = sch.cache_read(block, 1, "local")
        _pack(sch, packed, tile, lanes, loop_partition)

    sch.unroll(i_reg)
    vectorize_tile(sch, j_reg, lanes)
    sch.decompose_reduction(block, k)

    writer_loops = loops_below(sch, writer, tile)
    if writer_loops:
        # Not partitioned: TVM 0.27's LoopPartition miscompiles this write-back's predicate
        # (wrong rows for T >= 2 tiles), found by the tests; its check is outside the inner loop.
        vectorize_tile(sch, writer_loops[-1], lanes)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def _writes_operand(sch: s_tir.Schedule, producer, block, index: int) -> bool:
    """Whether ``producer`` writes the buffer the matmul reads as operand ``index``."""
    return sch.get(producer).writes[0].source.same_as(sch.get(block).reads[index].source)
