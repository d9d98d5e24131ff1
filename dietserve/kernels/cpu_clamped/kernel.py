"""The CPU micro-kernel for operators symbolic in both output axes (attention's products): clamped
register tiles, so no tile is padded, copied or bound-checked, even at the edges.

Padding a ``[T, T]`` result to whole tiles leaves a copy-out whose every element carries a bound
check (scalar stores, far slower than the FMAs they follow). Here the last tile
of an axis instead starts ``tile`` elements before the axis ends (``min(t * tile, extent - tile)``):
it overlaps its neighbour and recomputes a few elements, writing the same values, and every tile,
edge or not, is the same straight-line code of full-vector loads, FMAs and stores. Row tiles are
clamped inside their task's own block of rows, so no two tasks write the same row:

    parallel over (batch, row blocks of ti * mr rows; the last block takes the remainder):
        for each column tile of nr:                   j0 = jo * nr, then the columns left
                                                      (if any) on the narrowest tile of whole
                                                      vectors holding them: j0 = N - width
            [copy the K x nr B panel once into a contiguous local buffer]
            for each row tile of the block:           i0 = first + min(t * mr, rows - mr)
                acc[mr, nr] = 0                       register accumulators
                for k in K: acc += A[i0 + ii, k] * B[k, j0 + jj]    A broadcast, nr/lanes B vectors
                out[i0 + ii, j0 + jj] = epilogue(acc) stored once, vectorised
        [softmax the block's rows in place: attention's masked softmax, fused]

The body is built from the operator's own blocks (its product and its element-wise epilogue,
rebased on the tile), so it computes exactly what the PrimFunc does. Shapes smaller than a tile
(M < mr or N < nr) take smaller tiles in the same function (``_narrow``): the widest column tile
of whole vectors the columns hold, as many of the tile's rows as the rows hold; scalar code only
below 4 columns. The reduction needs no padding: its extent, symbolic or not, is the loop's.
"""

from __future__ import annotations

import math

from tvm import s_tir, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from ..plan.microkernel import MicroKernel
from ..tir.build import with_exact_buffers
from ..tir.computed_once import computed_once
from ..tir.matching import ScheduleMismatch
from ..tir.rebuild import MatmulExpressions, rebuild, uses
from ..tir.row_softmax import softmax_rows
from .settings import ClampedSettings

CLAMPED = "clamped"  # MicroKernel.cache_scopes marker of this family
PANEL = "B.local"  # ... and of its variant that copies each B panel once per task


def is_clamped(kernel: MicroKernel) -> bool:
    return CLAMPED in kernel.cache_scopes


class _Operator(MatmulExpressions):
    """The matmul's product and epilogue as expressions of (batch..., i, j, k)."""

    def __init__(self, func: tirx.PrimFunc):
        super().__init__(func)
        if len(self.iter_vars) < 3:
            raise ScheduleMismatch("expected a matmul block with its own loops")
        if [str(i) for i in self.result_indices] != [str(v) for v in self.iter_vars[:-1]]:
            raise ScheduleMismatch("the matmul's result is not indexed by its spatial axes")
        if self.epilogue is not None:
            if len(self.out_vars) != len(self.iter_vars) - 1:
                raise ScheduleMismatch("the epilogue is not one element-wise store over the result")
            reads = []
            rebuild(self.epilogue, {},
                    on_load=lambda load: reads.append(load) if load.source.same_as(self.result) else None)
            if not reads or any([str(i) for i in r.indices] != [str(v) for v in self.out_vars] for r in reads):
                raise ScheduleMismatch("the epilogue reads the result at another element")

    def operands(self) -> tuple[tirx.Expr, tirx.Expr] | None:
        """(the factor read along i, the factor read along j) of the product, if it splits so."""
        i_var, j_var = self.iter_vars[-3], self.iter_vars[-2]
        if not isinstance(self.product, tirx.Mul):
            return None
        factors = (self.product.a, self.product.b)
        along = [(uses(f, i_var), uses(f, j_var)) for f in factors]
        if along == [(True, False), (False, True)]:
            return factors
        if along == [(False, True), (True, False)]:
            return factors[1], factors[0]
        return None

    def factor(self, expr, batch, i, j, k) -> tirx.Expr:
        return rebuild(expr, dict(zip(self.iter_vars, [*batch, i, j, k], strict=True)))

    def term(self, batch, i, j, k) -> tirx.Expr:
        return rebuild(self.product, dict(zip(self.iter_vars, [*batch, i, j, k], strict=True)))

    def finish(self, value, batch, i, j) -> tirx.Expr:
        """The epilogue of ``value`` (the accumulated element at (batch, i, j))."""
        if self.epilogue is None:
            return value
        return rebuild(self.epilogue, dict(zip(self.out_vars, [*batch, i, j], strict=True)), {self.result: value})


def _batch_indices(task, extents) -> list:
    """``task`` in [0, prod(extents)) as one index per batch axis (row-major)."""
    indices, rest = [], task
    for position, extent in enumerate(extents):
        inner = math.prod(extents[position + 1:]) if position + 1 < len(extents) else 1
        indices.append(tirx.floormod(tirx.floordiv(rest, inner), extent) if position else tirx.floordiv(rest, inner))
    return indices


def clamped_fits(func: tirx.PrimFunc, kernel: MicroKernel) -> bool:
    """Whether ``kernel`` can compute ``func``: a multiply-accumulate with an element-wise
    epilogue, and no static row or column extent smaller than the tile (it would never take
    the tiled path)."""
    try:
        op = _Operator(func)
    except (ScheduleMismatch, s_tir.ScheduleError):
        return False
    *_, m, n, depth = op.extents
    (mr, *_), (nr,) = kernel.tile_sizes("i"), kernel.tile_sizes("j")
    if PANEL in kernel.cache_scopes and not _panel_copyable(op, depth):
        return False
    return all(not isinstance(extent, tirx.IntImm) or int(extent) >= tile for extent, tile in ((m, mr), (n, nr)))


def _panel_copyable(op: _Operator, depth) -> bool:
    """A B panel can be copied per task: a static reduction and a product of two operands."""
    return isinstance(depth, tirx.IntImm) and op.operands() is not None


def apply_cpu_clamped(func: tirx.PrimFunc, kernel: MicroKernel, row_softmax: bool = False, *,
                      settings: ClampedSettings) -> tirx.PrimFunc:
    """``func`` computed in clamped ``mr x nr`` register tiles, blocks of ``ti`` row tiles per
    task (``kernel.tile``: i=(mr, ti), j=(nr,)); with ``B.local`` in its scopes each
    ``depth x nr`` B panel is copied once per task into a contiguous buffer that all the task's
    row tiles read (a ``[d, T]`` operand's rows alias in L1 when T is a power of two).

    ``row_softmax``: the result's rows are then softmaxed in place by the task that wrote
    them, while they are still in cache (attention's masked softmax fused into the scores).
    Tasks own disjoint rows (the last block takes the remainder, and a clamped tile stays
    inside its block), so no task writes rows another one is normalising."""
    (mr, *rest), (nr,) = kernel.tile_sizes("i"), kernel.tile_sizes("j")
    ti = rest[0] if rest else 1
    lanes = kernel.vector
    if nr % lanes:
        raise ScheduleMismatch(f"column tile {nr} is not a whole number of {lanes}-lane vectors")
    op = _Operator(func)
    *batch, m, n, depth = op.extents
    panel = PANEL in kernel.cache_scopes
    if panel and not _panel_copyable(op, depth):
        raise ScheduleMismatch("a copied B panel needs a static reduction and a product of two operands")
    parallel = kernel.threads != 1
    softmax_lanes = lanes if row_softmax else 0
    # The tiled path needs a whole tile in each axis; a condition that always holds is left out
    # (its dead scalar branch would be simplified under m == 0, where TVM folds a division by 0).
    fits = [m >= mr] if mr > 1 else []
    fits += [] if isinstance(n, tirx.IntImm) and int(n) >= nr else [n >= nr]
    with IRBuilder() as builder:
        if not fits:
            _tiled(op, batch, (m, n, depth), (mr, nr, ti), lanes, panel, parallel, softmax_lanes, settings)
        else:
            with T.If(tirx.all(*fits)):
                with T.Then():
                    _tiled(op, batch, (m, n, depth), (mr, nr, ti), lanes, panel, parallel, softmax_lanes, settings)
                with T.Else():  # smaller than one tile
                    _narrow(op, batch, (m, n, depth), mr, nr, lanes, parallel, softmax_lanes, settings)
    return with_exact_buffers(func.with_body(builder.get()).with_attr("tirx.is_scheduled", True))


def _narrow(op, batch, extents, mr, nr, lanes, parallel, softmax_lanes, settings: ClampedSettings) -> None:
    """Shapes smaller than the kernel's tile: the widest column tile of whole vectors the
    columns hold (``nr``, then halved vectors down to 4 lanes), scalar below 4 columns; in each,
    the kernel's ``mr`` rows at a time where the rows hold them, else 4, else one. Attention's
    scores at short lengths have fewer columns than one AVX-512 vector: as scalar code, or as
    one-row tasks, they would take several times as long as a vector tile over many rows."""
    m, n, _depth = extents
    widths, heights = _narrow_options(mr, nr, lanes)

    def columns(width) -> None:
        if width is None:  # fewer than 4 columns: scalar
            _tiled(op, batch, extents, (1, 1, 1), 1, False, parallel, softmax_lanes, settings)
            return
        _first_that_fits(heights, lambda height: m >= height, lambda height: _tiled(
            op, batch, extents, (height, width, 1), tile_lanes(width, lanes), False, parallel, softmax_lanes,
            settings))

    _first_that_fits([*widths, None], lambda width: n >= width, columns)


def _narrow_options(mr: int, nr: int, lanes: int) -> tuple[list[int], list[int]]:
    """(column widths, row heights) of the tiles ``_narrow`` picks from, the first that fits."""
    return [nr] + [w for w in (lanes, lanes // 2, lanes // 4) if 4 <= w < nr], sorted({mr, min(mr, 4), 1}, reverse=True)


def tile_lanes(width: int, lanes: int) -> int:
    """The lanes of the vectors a ``width``-wide column tile computes with, on a machine of
    ``lanes``: a narrow tile's vectors are no wider than the tile."""
    return min(width, lanes)


def tile_at(kernel: MicroKernel, rows: int, columns: int) -> tuple[int, int]:
    """The (rows, columns) register tile a clamped kernel computes a ``rows x columns`` shape
    with: its own where the shape holds one, else ``_narrow``'s (1 column: scalar)."""
    (mr, *_), (nr,) = kernel.tile_sizes("i"), kernel.tile_sizes("j")
    if rows >= mr and columns >= nr:
        return mr, nr
    widths, heights = _narrow_options(mr, nr, kernel.vector)
    return next((h for h in heights if rows >= h), 1), next((w for w in widths if columns >= w), 1)


def _first_that_fits(options: list, fits, emit) -> None:
    """``emit(option)`` for the first of ``options`` that ``fits`` at run time (a chain of
    conditions in the kernel), the last one unconditionally."""
    first, *rest = options
    if not rest:
        emit(first)
        return
    with T.If(fits(first)):
        with T.Then():
            emit(first)
        with T.Else():
            _first_that_fits(rest, fits, emit)


def softmax_after(scheduled: tirx.PrimFunc, func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc:
    """``scheduled`` (any kernel of ``func``) followed by a softmax over every row of its result,
    in place, rows split over the cores: the fused operator for a variant that is not a
    clamped-tile kernel."""
    op = _Operator(func)
    *batch, m, n, _ = op.extents
    with IRBuilder() as builder:
        with T.parallel(0, math.prod(batch) * m if batch else m) as row:
            z = _batch_indices(tirx.floordiv(row, m), batch) if batch else []
            softmax_rows(op.out, lambda r: (*z, tirx.floormod(row, m) + r), 1, n, lanes)
    return scheduled.with_body(tirx.SeqStmt([scheduled.body, builder.get()]))


def _tiled(op, batch, extents, tile, lanes, panel, parallel, softmax_lanes, settings: ClampedSettings) -> None:
    """The loop nest; ``softmax_lanes`` > 0: then softmax each task's rows, that many lanes wide."""
    (m, n, depth), (mr, nr, ti) = extents, tile
    rows_per_block = mr * ti
    blocks = tirx.max(m // rows_per_block, 1)  # the last block also takes the remainder (< mr * ti rows)
    loop = T.parallel if parallel else T.serial
    with loop(0, math.prod(batch) * blocks if batch else blocks) as task:
        z = _batch_indices(tirx.floordiv(task, blocks), batch) if batch else []
        block = tirx.floormod(task, blocks)
        first = block * rows_per_block
        rows = tirx.Select(block == blocks - 1, m - first, tirx.const(rows_per_block, "int64"))
        *z, first, rows = computed_once(*z, first, rows)  # (divisions by the symbolic row blocks: ``computed_once``)

        def column_tile(j0, width: int) -> None:
            _column_tile(op, z, first, rows, j0, (mr, width), lanes, panel, depth)

        if nr == 1:
            with T.serial(0, n) as jo:
                column_tile(jo, 1)
        else:
            _column_tiles(n, nr, lanes, column_tile, settings.remainder_columns)
        if softmax_lanes:
            softmax_rows(op.out, lambda r: (*z, first + r), rows, n, softmax_lanes)


def _column_tiles(n, nr: int, lanes: int, column_tile, remainder_columns: bool) -> None:
    """``column_tile(j0, width)`` over ``n`` columns: whole ``nr``-wide tiles, then the columns
    left (if any) in the narrowest tile of whole vectors that holds them (``remainder_columns``),
    which ends at the last column: it starts before them and recomputes a few of the previous
    tile's columns, writing the same values."""
    whole = n // nr
    with T.serial(0, whole) as jo:
        column_tile(jo * nr, nr)
    if isinstance(n, tirx.IntImm) and int(n) % nr == 0:
        return
    left = n - whole * nr
    with T.If(left > 0):
        with T.Then():
            _first_that_fits(_last_tile_widths(nr, lanes, remainder_columns), lambda width: left <= width,
                             lambda width: column_tile(n - width, width))


def computed_columns(columns: int, width: int, lanes: int, settings: ClampedSettings | None = None) -> int:
    """How many columns ``width``-wide tiles of ``lanes``-lane vectors compute for ``columns``
    (at least ``width``; ``_column_tiles``), the recomputed ones included; ``settings``: what the
    kernel is built with (None: the defaults, the same on every target)."""
    remainder_columns = (settings or ClampedSettings()).remainder_columns
    whole, left = divmod(columns, width)
    if not left or width == 1:
        return columns
    return whole * width + next(w for w in _last_tile_widths(width, lanes, remainder_columns) if w >= left)


def _last_tile_widths(nr: int, lanes: int, remainder_columns: bool) -> list[int]:
    """The widths the columns left after whole ``nr``-wide tiles may take, narrowest first: the
    narrower tiles of whole vectors (``remainder_columns``), then ``nr``. The first that holds
    them is taken, by the kernel (``_column_tiles``) and by the cost model's count of the columns
    it computes (``computed_columns``) alike."""
    return [*range(lanes, nr, lanes), nr] if remainder_columns else [nr]


def _column_tile(op, z, first, rows, j0, tile, lanes, panel, depth) -> None:
    """One column tile (``width`` columns from ``j0``) over the task's rows, ``mr`` at a time."""
    (mr, width), dtype = tile, op.result.dtype
    zero = tirx.const(0, dtype)
    no_index = tirx.const(0, "int64")
    if panel:
        a_factor, b_factor = op.operands()
        b_panel = T.alloc_buffer((int(depth), width), dtype, scope="local")
        with T.serial(0, depth) as k:
            _vector_loop(width, lanes, lambda jj: T.buffer_store(
                b_panel, op.factor(b_factor, z, no_index, j0 + jj, k), [k, jj]))

        def term(ii, jj, k):
            return op.factor(a_factor, z, i0 + ii, no_index, k) * b_panel[k, jj]
    else:
        def term(ii, jj, k):
            return op.term(z, i0 + ii, j0 + jj, k)
    with T.serial(0, (rows + (mr - 1)) // mr) as t:
        i0 = first + tirx.min(t * mr, rows - mr) if mr > 1 else first + t
        acc = T.alloc_buffer((mr, width), dtype, scope="local")
        with T.unroll(0, mr) as ii:
            _vector_loop(width, lanes, lambda jj: T.buffer_store(acc, zero, [ii, jj]))
        with T.serial(0, depth) as k:
            with T.unroll(0, mr) as ii:
                _vector_loop(width, lanes, lambda jj: T.buffer_store(acc, acc[ii, jj] + term(ii, jj, k), [ii, jj]))
        with T.unroll(0, mr) as ii:
            _vector_loop(width, lanes, lambda jj: T.buffer_store(
                op.out, op.finish(acc[ii, jj], z, i0 + ii, j0 + jj), [*z, i0 + ii, j0 + jj]))


def _vector_loop(width, lanes, store) -> None:
    """``store(jj)`` for jj in [0, width): whole vectors, the vector count unrolled."""
    if lanes == 1:
        with T.serial(0, width) as jj:
            store(jj)
        return
    with T.unroll(0, width // lanes) as jv:
        with T.vectorized(0, lanes) as lane:
            store(jv * lanes + lane)


__all__ = ["CLAMPED", "apply_cpu_clamped", "clamped_fits", "computed_columns", "is_clamped", "tile_at", "tile_lanes"]
