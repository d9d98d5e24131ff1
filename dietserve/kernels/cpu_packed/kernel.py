"""The CPU GEMM micro-kernel on packed weights: the loop nest of a BLAS sgemm, for every T.

The operator reads its weight as ``Wp[N / P, K, P]`` (``packing.py``), so one register tile
streams a contiguous panel. The kernel is emitted with the IR builder from the operator's own
product and epilogue expressions (as ``cpu_clamped/kernel.py`` does), not scheduled from its
blocks:

    parallel over (task: nb panels x mr rows):
        for each group of pk panels:                 the register tile: mr x (pk * P)
            acc[r][p] = 0, one small buffer per      (each row's vectors: values LLVM keeps
            for k in K:          row and panel         in registers)
                for r, p, v: acc[r][p][v] += X[row(r), k] * Wp[panel + p, k, v]
            for r: if row r is real: out[row, cols] = epilogue(acc[r])   stored once, vectorised
                                                      (a large epilogue, BERT's GELU: acc to the
                                                      stack, then one loop over the rows)

A row count that is not whole ``mr`` tiles ends in a *remainder tile*: the last row pass runs
the shortest of a few shorter copies of the tile (``remainder_heights``: 1, 2, 4, 7, 10, 12 rows)
that holds the rows left, chosen by a branch per pass, as a BLAS library's edge kernels are;
its few padded rows read the last real row of X (``min(i0 + r, T - 1)``, loop-invariant in k)
and the epilogue runs on the real rows only, in a loop after it. A remainder tile spans as
many of the task's groups of ``pk`` panels as keep it within the whole tile's registers
(``Tile.widening``): a 1 x 16 AVX2 tile has 2 FMA chains where the core needs 8 to hide the
FMA's latency, so it runs 1 x 64. So a short shape passes over the weight once, on a tile at
most a third padding, at the FMA rate. Built without them (``PackedSettings.remainder_tiles``),
the last pass computes the whole tile, its padded rows never stored.

With ``kc`` < K (the reduction in blocks, BLIS order) a task is ``nb`` panels over all rows: a
``kc``-deep block of its panels stays in L2 while every row tile passes over it, and partial
sums wait in the task's workspace between blocks; the last block applies the epilogue from
the registers. Where a task has enough row passes, the ones after its first also prefetch the
weight block it reads next, one cache line per reduction step (``NextBlock``).

A tile whose rows would crowd one L1 set (``crowding_rows``: a row stride of a multiple of
4 KB, more rows than the set's ways, and at least as many rows to compute) reads its rows from
a k-major copy made first, in parallel (``packed_rows``; the padded rows again repeat the last
real one): each step's broadcasts then come from one line. Its remainder tiles too short to
crowd a set read their rows in place (``PackedSettings.remainder_rows_in_place``).

A bf16 kernel (``bf16.py``) converts X's rows to pairs first, row-major and a vector at a time
(``paired_rows``), or k-major where those rows would crowd a set (``packed_rows``).

The parts: ``tile`` (the operator's expressions, the register tile and its remainder tiles),
``loop_nests`` (the two reduction loop nests, the row copy), ``prefetch`` (``NextBlock``,
``stream_ahead``), ``claimed_tasks`` (the task loop), ``settings`` (what is switched on).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from ..plan.microkernel import MicroKernel
from ..tir.build import with_exact_buffers
from ..tir.matching import ScheduleMismatch
from ..tir.rebuild import expression_size
from . import bf16
from .claimed_tasks import task_loop
from .loop_nests import blocked_reduction, packed_rows, paired_rows, whole_reduction
from .prefetch import CACHE_LINE_BYTES
from .settings import PackedSettings
from .tile import PackedOperator, Tile, remainder_heights


def packed_tile(kernel: MicroKernel) -> tuple[int, int, int, int]:
    """(mr, panel, panels per register tile, panels per task) of a packed micro-kernel."""
    (mr,) = kernel.tile_sizes("i")
    panel, pk, groups = kernel.tile_sizes("j")
    return mr, panel, pk, pk * groups


def apply_cpu_packed(func: tirx.PrimFunc, kernel: MicroKernel, workers: int | None = None, *,
                     settings: PackedSettings) -> tirx.PrimFunc:
    """``func`` (already reading its weight packed, ``pack_prim_func``) as ``kernel``'s loop nest;
    ``workers``: the threads that take its tasks at run time (``claimed_tasks``: the target's
    cores), None: TVM's even split of them; ``settings``: the target's (``packed_settings``)."""
    mr, panel, pk, nb = packed_tile(kernel)
    lanes = kernel.vector
    if panel % lanes:
        raise ScheduleMismatch(f"panel width {panel} is not a whole number of {lanes}-lane vectors")
    op = PackedOperator(func)
    rows, panels, width, depth = op.extents
    if not isinstance(width, tirx.IntImm) or int(width) != panel or not isinstance(panels, tirx.IntImm) \
            or int(panels) % nb:
        raise ScheduleMismatch(f"weight packing does not fit {nb} panels of {panel} per task")
    kc = kernel.tile_sizes("k")[0]
    blocked = isinstance(depth, tirx.IntImm) and reduces_in_blocks(kernel, int(depth))
    if blocked and int(depth) % kc:
        raise ScheduleMismatch(f"reduction of {depth} is not a whole number of {kc}-deep blocks")
    epilogue_loop = settings.epilogue_loop and expression_size(op.epilogue) > settings.epilogue_unrolled_nodes
    tile = Tile(op, mr, panel, pk, lanes, rows, settings.remainder_tiles, epilogue_loop)
    loop = T.parallel if kernel.threads != 1 else T.serial
    tasks = task_loop(kernel.threads, loop, workers, settings.claimed_tasks)
    if op.bf16 and not settings.dot_pairs:
        raise ScheduleMismatch("a bf16 kernel needs a target with AVX512-BF16 (vdpbf16ps)")
    if op.bf16 and lanes != bf16.PAIR_LANES:
        raise ScheduleMismatch(f"a bf16 kernel's vectors are {bf16.PAIR_LANES} sums, not {lanes}")
    crowding = crowding_rows(mr, int(depth) * op.activation.source.dtype.bits // 8, settings) \
        if settings.pack_rows and op.activation is not None and isinstance(depth, tirx.IntImm) else None
    prefetch, distance, spread = settings.prefetch_next_block, settings.stream_ahead_bytes, settings.spread_next_block

    def reduction(tile: Tile) -> None:
        if blocked:
            blocked_reduction(tile, tasks, int(panels) // nb, nb, depth, kc, prefetch, distance, spread)
        else:
            whole_reduction(tile, tasks, int(panels) // nb, nb, depth, prefetch, distance, spread)

    with IRBuilder() as builder, T.seq_scope():
        if op.bf16 and crowding is None and op.pairs_by_vector(int(depth)):
            # its rows converted to pairs once, not once per panel group, in place of X's
            reduction(tile.with_paired_rows(paired_rows(tile, loop, int(depth))))
        elif op.bf16:  # (k-major: the rows as pairs would crowd a set, or be no whole vectors)
            reduction(tile.with_rows_copied(packed_rows(tile, loop, int(depth))))
        elif crowding is None:
            reduction(tile)
        else:
            # With fewer rows the tile's padded rows read the last real one again: they crowd
            # no set, and the copy would only cost. Those fewer rows are one remainder pass: the
            # whole tile is emitted once, not twice (its build time grows with each copy).
            with T.If(rows >= crowding):
                with T.Then():
                    reduction(tile.with_rows_copied(packed_rows(tile, loop, int(depth)),
                                                    crowding if settings.remainder_rows_in_place else None))
                with T.Else():
                    reduction(tile.with_fewer_rows_than(crowding))
    body = builder.get().body  # (inside seq_scope's frame, which only let two loops follow each other)
    if prefetch or distance:
        body = tirx.SeqStmt([tirx.DeclBuffer(op.flat_weight, data=op.weight.data), body])
    if op.bf16:
        body = bf16.importing_bf16_functions(body)
    return with_exact_buffers(func.with_body(body).with_attr("tirx.is_scheduled", True), own_storage=True)


def reduces_in_blocks(kernel: MicroKernel | None, depth: int) -> bool:
    """A packed kernel whose reduction of ``depth`` runs in ``kc``-deep blocks (BLIS order,
    ``blocked_reduction``), not whole in registers (``whole_reduction``)."""
    if kernel is None or not kernel.pack:
        return False
    return 1 < kernel.tile_sizes("k")[0] < depth


def with_whole_reduction(kernel: MicroKernel) -> MicroKernel:
    """``kernel`` with its reduction whole in registers (its ``k`` tile 1), the rest alike."""
    tile = tuple((axis, (1,) if axis == "k" else sizes) for axis, sizes in kernel.tile)
    return dataclasses.replace(kernel, tile=tile)


def computed_extent(kernel: MicroKernel, axis: str, extent: int, settings: PackedSettings | None = None) -> int:
    """How much of ``axis`` ``kernel`` computes for a shape ``extent`` long, padding included:
    whole tiles, but a packed kernel's rows end in a remainder tile (``remainder_heights``; an
    AMX kernel's in a whole tile); ``settings``: what it is built with (None: the defaults, the
    same for every target here)."""
    tile = kernel.tile_of(axis)
    remainder_tiles = (settings or PackedSettings()).remainder_tiles
    if not (kernel.pack and axis == "i" and remainder_tiles and not kernel.mma) or extent % tile == 0:
        return -(-extent // tile) * tile
    left = extent % tile
    return extent - left + next(height for height in remainder_heights(tile) if height >= left)


def crowding_rows(mr: int, row_bytes: int, settings: PackedSettings | None = None) -> int | None:
    """The fewest of an ``mr``-row tile's rows, ``row_bytes`` apart, of which more share one L1
    set than it has ways (``settings``' L1 geometry; None: the defaults); None where its rows
    never crowd a set."""
    settings = settings or PackedSettings()
    sets: Counter = Counter()
    for r in range(mr):
        line = r * row_bytes % settings.l1_set_span_bytes // CACHE_LINE_BYTES
        sets[line] += 1
        if sets[line] > settings.l1_ways:
            return r + 1
    return None


__all__ = ["apply_cpu_packed", "computed_extent", "crowding_rows", "packed_tile", "reduces_in_blocks",
           "remainder_heights", "with_whole_reduction"]
