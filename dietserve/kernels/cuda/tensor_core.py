"""Apply a tensor-core (WMMA) micro-kernel to a matmul-like fp32 PrimFunc, for every value of its
symbolic dims: fp16 operands, fp32 accumulation, fp32 in and out.

The loop nest (``tile = i: (16, fm, wy), j: (16, fn, wx), k: (16, fk)``; one thread block per
``bm x bn`` output tile, ``bm = 16 fm wy``, ``bn = 16 fn wx``; ``wy x wx`` warps of 32 threads):

    blockIdx.z/y/x over batch x ceil(M / bm) x ceil(N / bn), threadIdx.y over the warps:
        acc[fm, fn] fragments = 0                                            (registers)
        for each reduction step of bk = 16 fk:
            A_s[bm, bk], B_s[bk, bn] <- fp16(global fp32), zero-padded, by all threads  <- checks
            for fk: load fm A and fn B fragments from shared; fm x fn wmma::mma_sync   <- none
        acc -> C_s[bm, bn] (fp32, the other shared scope, wmma::store_matrix_sync)
        C_s's real rows/columns -> global through the epilogue (bias, GELU, residual)  <- checks

Local padding as in ``kernel.py``: ``pad_einsum`` pads the iteration space to whole block tiles;
the padded operands become the shared-memory tiles, filled with zeros past the real rows at each
step, so the mma loop runs whole fragments with no checks for any T. The cast to fp16 is part of
each fill (``unsafe_set_dtype`` on the staged tile): the PrimFunc keeps its fp32 signature, so
it links into the fp32 model as any other kernel does. A cast in the fill rules out cp.async,
which copies bytes unchanged; the fill is instead software-pipelined through registers: the
global loads of step k+1 are issued before the mma of step k (``pipeline``).
"""

from __future__ import annotations

from tvm import s_tir, tirx

from ..plan.microkernel import MMA_FRAGMENT, MicroKernel
from ..tir.loops import loops_below, static_extent
from ..tir.matching import ScheduleMismatch, find_matmul, pad_to_tiles
from .kernel import fill_tile, operand_stage, vector_lanes
from .wmma import wmma_intrinsics

__all__ = ["apply_tensor_core"]

WARP = 32
# (operand tiles, result tile): two scopes, so that TVM 0.27's StorageRewrite never places the
# fp32 result tile in a dead fp16 operand tile's memory (the wmma store's fp32 pointer into an
# fp16 buffer then fails to lower: "tvm_access_ptr element type must match").
_SCOPES = (("shared", "shared.dyn"), ("shared.dyn", "shared"))
_INPUT_DTYPES = {"wmma_f16": "float16"}
# Shared-memory rows padded past the tile (elements): wmma needs 16-byte row strides, and the
# pad moves successive rows to other banks. As dlight's tensor-core rule pads them.
_OPERAND_ROW_PAD, _RESULT_ROW_PAD = 8, 4


def _tile(kernel: MicroKernel) -> tuple[int, int, int, int, int]:
    """(fm, wy, fn, wx, fk) of a tensor-core kernel, or ScheduleMismatch."""
    if kernel.mma not in _INPUT_DTYPES:
        raise ScheduleMismatch(f"not a tensor-core micro-kernel: {kernel}")
    (_, fm, wy), (_, fn, wx), (_, fk) = (kernel.tile_sizes(axis) for axis in ("i", "j", "k"))
    return fm, wy, fn, wx, fk


def _split_loops(sch: s_tir.Schedule, block, fm: int, wy: int, fn: int, wx: int, fk: int):
    """Block tile -> warp grid -> fragments -> one 16x16x16 product; returns the loops the stages
    attach to: (reduction step, fragment step, warp, the product's outermost)."""
    f = MMA_FRAGMENT
    *batch, i, j, k = sch.get_loops(block)
    i_tile, i_warp, i_frag, i_in = sch.split(i, [None, wy, fm, f])
    j_tile, j_warp, j_frag, j_in = sch.split(j, [None, wx, fn, f])
    k_step, k_frag, k_in = sch.split(k, [None, fk, f])
    sch.reorder(*batch, i_tile, j_tile, i_warp, j_warp, k_step, k_frag, i_frag, j_frag, i_in, j_in, k_in)
    if batch:
        sch.bind(sch.fuse(*batch) if len(batch) > 1 else batch[0], "blockIdx.z")
    sch.bind(i_tile, "blockIdx.y")
    sch.bind(j_tile, "blockIdx.x")
    warp = sch.fuse(i_warp, j_warp)
    sch.bind(warp, "threadIdx.y")
    return k_step, k_frag, warp, i_in


def _stage_operands(sch: s_tir.Schedule, block, operands: list, k_step, warps: int, kernel: MicroKernel) -> list:
    """Both ``operands`` as fp16 shared-memory tiles filled by all threads at each reduction step:
    ``operand_stage``'s copies."""
    scope, dtype = kernel.cache_scopes[0], _INPUT_DTYPES[kernel.mma]
    fills = []
    for index, operand in enumerate(operands):
        stage, staged = operand_stage(sch, block, index, scope)
        sch.unsafe_set_dtype(stage, 0, dtype)
        fill_tile(sch, stage, k_step, (warps, WARP), vector_lanes(operand, staged, kernel.vector))
        sch.storage_align(stage, 0, axis=-2, factor=16, offset=_OPERAND_ROW_PAD)
        fills.append(stage)
    return fills


def _stage_result(sch: s_tir.Schedule, mma, epilogue, padded: bool, warp, scope: str):
    """Accumulator fragments -> the warp's part of a shared fp32 tile -> global, through the
    epilogue, real elements only. Returns (fragment store block, write-back block)."""
    store = sch.cache_write(mma, 0, "wmma.accumulator")
    sch.reverse_compute_at(store, warp)
    if padded:  # the padded result lives only in shared memory; the epilogue writes real elements
        sch.set_scope(store, 0, scope)
        writer = epilogue
    else:
        writer = sch.cache_write(store, 0, scope)
        if epilogue is not None:
            try:
                sch.reverse_compute_inline(epilogue)
            except s_tir.ScheduleError as err:
                raise ScheduleMismatch(f"cannot fold the epilogue into the write-back: {err}") from err
    sch.storage_align(store, 0, axis=-2, factor=16, offset=_RESULT_ROW_PAD)
    sch.reverse_compute_at(writer, warp)
    _, lane = sch.split(sch.fuse(*loops_below(sch, writer, warp)), [None, WARP])
    sch.bind(lane, "threadIdx.x")
    return store, writer


def _fragment_loops(sch: s_tir.Schedule, block) -> object:
    """A fragment-shaped copy's last two loops split into 16x16 pieces; returns the piece's outer."""
    i, j = sch.get_loops(block)[-2:]
    i_outer, i_inner = sch.split(i, [None, MMA_FRAGMENT])
    j_outer, j_inner = sch.split(j, [None, MMA_FRAGMENT])
    sch.reorder(i_outer, j_outer, i_inner, j_inner)
    return i_inner


def _tensorize(sch: s_tir.Schedule, block, mma, k_frag, k_step, store, scopes: tuple[str, str]) -> None:
    """Fragment loads, zero fill, mma and fragment store as WMMA intrinsics."""
    intrinsics = wmma_intrinsics(*scopes)
    loads = [sch.cache_read(mma, 0, "wmma.matrix_a"), sch.cache_read(mma, 1, "wmma.matrix_b")]
    for fragment, name in zip(loads, ("load_a", "load_b"), strict=True):
        sch.compute_at(fragment, k_frag)
        sch.tensorize(_fragment_loops(sch, fragment), intrinsics[name])
    init = sch.decompose_reduction(mma, k_step)
    try:
        sch.tensorize(sch.get_loops(sch.get_child_blocks(init)[0])[-2], intrinsics["init"])
        sch.tensorize(_fragment_loops(sch, store), intrinsics["store"])
        sch.tensorize(sch.get_loops(block)[-3], intrinsics["compute"])
    except s_tir.ScheduleError as err:
        raise ScheduleMismatch(f"the product does not match the {intrinsics['compute']} intrinsic: {err}") from err


def _pipeline(sch: s_tir.Schedule, k_step, fills: list) -> None:
    """Each fill split into global -> registers and registers -> shared; the global loads of the
    next step issued before this step's mma, the shared stores after it (two stages)."""
    for fill in fills:
        sch.annotate(fill, "tirx.manifest_shared_memory_local_stage", 1)
    # k_step's body once the fills are split: A load, A store, B load, B store, the mma loop.
    sch.annotate(k_step, "software_pipeline_stage", [0, 0, 0, 0, 1])
    sch.annotate(k_step, "software_pipeline_order", [0, 3, 1, 4, 2])


def apply_tensor_core(func: tirx.PrimFunc, kernel: MicroKernel, loop_partition: bool = False,
                      pipeline: bool = True) -> tirx.PrimFunc:
    """Schedule ``func`` (symbolic) with tensor-core ``kernel``; raises ScheduleMismatch if it
    does not fit. ``pipeline``: overlap the next step's global loads with this step's mma.
    ``loop_partition`` applies to unpipelined kernels only: the pipeline already splits off the
    steps around its steady state, and partitioning that again (TVM 0.27) duplicates the last
    step under step-count checks without taking any check out of the mma loop."""
    # Analyse: a tensor-core micro-kernel and one product of two operands to apply it to.
    fm, wy, fn, wx, fk = _tile(kernel)
    scopes = tuple(kernel.cache_scopes)
    if scopes not in _SCOPES:
        raise ScheduleMismatch(f"tensor-core operand and result tiles live in one of {_SCOPES}, not {scopes}")
    sch = s_tir.Schedule(func)
    block, epilogue = find_matmul(sch)
    operands = [region.source for region in sch.get(block).reads]
    if len(operands) != 2:
        raise ScheduleMismatch(f"expected a product of two operands, the reduction reads {len(operands)}")
    f = MMA_FRAGMENT
    padded, epilogue = pad_to_tiles(sch, block, epilogue, (f * fm * wy, f * fn * wx, f * fk))

    # Schedule: tiles and warps, fp16 operand tiles, the 16x16x16 product as one block, the result.
    k_step, k_frag, warp, product = _split_loops(sch, block, fm, wy, fn, wx, fk)
    fills = _stage_operands(sch, block, operands, k_step, wy * wx, kernel)
    mma = sch.blockize(product)
    store, _ = _stage_result(sch, mma, epilogue, padded, warp, scopes[1])
    _tensorize(sch, block, mma, k_frag, k_step, store, scopes)
    if kernel.unroll:
        outermost = sch.get_loops(mma)[0]
        sch.annotate(outermost, "pragma_auto_unroll_max_step", kernel.unroll)
        sch.annotate(outermost, "pragma_unroll_explicit", 1)
    if pipeline:
        _pipeline(sch, k_step, fills)
    elif loop_partition and static_extent(sch.get(k_step).extent) is None:
        sch.annotate(k_step, "pragma_loop_partition_hint", 1)  # as in kernel.py: symbolic steps only
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)
