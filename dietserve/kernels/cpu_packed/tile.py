"""The packed GEMM kernel's register tile (``kernel.py``): the operator's expressions and
the code of one ``mr x (pk * panel)`` tile: accumulators, multiply-adds, epilogue, and the
remainder tiles a last row pass with fewer rows runs instead (``Tile.passes``)."""

from __future__ import annotations

import copy
import math

import tvm_ffi
from tvm import tirx
from tvm.script.ir_builder import tirx as T

from ..tir.matching import ScheduleMismatch
from ..tir.rebuild import MatmulExpressions, reads, rebuild
from . import bf16

# The remainder tiles' heights: each holds at most a third padding below the next. 12 is for
# 14-row tiles (the tallest of 32-wide AVX-512 panels, which plans pick for 11-14 rows in one
# pass): without it they would compute 14 rows for 11 or 12. Each height is one more copy of
# the tile's code to build.
REMAINDER_LADDER = (1, 2, 4, 7, 10, 12)


def remainder_heights(mr: int) -> list[int]:
    """The remainder tiles of an ``mr``-row tile, shortest first: the rows left (1 .. mr - 1)
    run on the shortest that holds them (``mr`` itself, padded, past the ladder's tallest), so
    at most a third of its rows are padding."""
    return [height for height in REMAINDER_LADDER if height < mr] + [mr]


def register_footprint(rows: int, vectors: int) -> int:
    """Vector registers an ``rows x vectors`` register tile holds: its accumulators, the B
    vectors a row reuses (one when a single row uses each once), one broadcast (the space's
    rule, ``dietserve/kernels/space/cpu.py``)."""
    return rows * vectors + (vectors if rows > 1 else 1) + 1


def _holding(heights: list[int], rows: int) -> int:
    """The index of the first of ``heights`` (ascending) that holds ``rows``."""
    return next(index for index, height in enumerate(heights) if height >= rows)


class PackedOperator(MatmulExpressions):
    """The packed dense layer's product and epilogue as expressions of (row, panel, lane, k)
    and (row, column)."""

    def __init__(self, func: tirx.PrimFunc):
        super().__init__(func)
        if len(self.iter_vars) != 4:
            raise ScheduleMismatch("expected a packed dense layer: rows, panels, panel columns, reduction")
        if self.epilogue is None:
            raise ScheduleMismatch("a packed kernel needs an epilogue to write the unpacked output")
        if len(self.out_vars) != 2:
            raise ScheduleMismatch("the epilogue is not one element-wise store over (rows, columns)")
        weights, others = [], []
        rebuild(self.product, {}, on_load=lambda load: (weights if len(load.indices) == 3 else others).append(load))
        if len(weights) != 1:
            raise ScheduleMismatch("expected the product to read one packed weight [panels, K, panel]")
        self.weight = weights[0].source
        # The activation X[row, k], when the product reads one: what ``packed_rows`` copies.
        # (a bf16 product reads it twice, in its rounding: ``bf16.rounded``)
        one = others and all(load.source.same_as(others[0].source) for load in others)
        self.activation = others[0] if one and len(others[0].indices) == 2 else None
        # bf16 (``bf16.py``): the weight is pairs of reduction steps, the loops run over pairs.
        self.bf16 = self.weight.dtype == "uint32"
        if self.bf16:
            if self.activation is None:
                raise ScheduleMismatch("a bf16 kernel converts one activation X[row, k] to pairs")
            *outer, depth = self.extents
            self.extents = [*outer, tirx.const(int(depth) // 2, depth.ty.dtype)]
            # (the product's other side: the activation, rounded)
            self._x_side = self.product.a if reads(self.product.b, self.weight) else self.product.b
        # The weight as one array, for the prefetches: their addresses then step by a constant.
        size = math.prod(int(extent) for extent in self.weight.shape)
        self.flat_weight = tirx.decl_buffer((size,), self.weight.dtype, "weight_flat", data=self.weight.data)

    def term(self, row, panel, lane, k, activation=None) -> tirx.Expr:
        """The product at (row, panel, lane, k); ``activation``: X[row, k] read from elsewhere."""
        loads = {} if activation is None else {self.activation.source: activation}
        return rebuild(self.product, dict(zip(self.iter_vars, [row, panel, lane, k], strict=True)), loads)

    def pairs_by_vector(self, depth: int) -> bool:
        """Whether a bf16 product's rows convert to pairs a vector at a time (``activation_pairs``):
        its activation is X itself, rounded, and ``depth`` pair steps are whole vectors."""
        return self.bf16 and depth % bf16.PAIR_LANES == 0 and tvm_ffi.structural_equal(
            self._x_side, bf16.rounded(self.activation), map_free_vars=True)

    def activation_pairs(self, row, k0) -> tirx.Expr:
        """bf16: the 16 pairs of X's row from pair step ``k0``, as one vector (one
        ``bf16.adjacent_pairs`` of two vector loads; ``pairs_by_vector``)."""
        at = lambda first: rebuild(self.activation, {self.iter_vars[0]: row, self.iter_vars[3]: tirx.Ramp(  # noqa: E731
            first, tirx.const(1, first.ty.dtype), bf16.PAIR_LANES)})
        step = 2 * k0
        return bf16.adjacent_pairs(at(step), at(step + bf16.PAIR_LANES))

    def activation_at(self, row, k) -> tirx.Expr:
        """X[row, k]; bf16: the pair of its steps 2k and 2k + 1, rounded (``bf16.pair``)."""
        if self.bf16:
            at = lambda step: rebuild(self._x_side, {self.iter_vars[0]: row, self.iter_vars[3]: step})  # noqa: E731
            return bf16.pair(at(2 * k), at(2 * k + 1))
        return rebuild(self.activation, {self.iter_vars[0]: row, self.iter_vars[3]: k})

    @property
    def activation_dtype(self) -> str:
        return "uint32" if self.bf16 else self.activation.source.dtype

    def finish(self, value, row, column) -> tirx.Expr:
        return rebuild(self.epilogue, dict(zip(self.out_vars, [row, column], strict=True)), {self.result: value})



class Tile:
    """One ``mr x (pk * panel)`` register tile's code: accumulators, FMAs, stores."""

    def __init__(self, op: PackedOperator, mr: int, panel: int, pk: int, lanes: int, rows, remainder_tiles: bool,
                 epilogue_loop: bool = False):
        self.op, self.mr, self.panel, self.pk, self.lanes, self.rows = op, mr, panel, pk, lanes, rows
        # The epilogue in one loop over the tile's rows (``finish``), not once per row.
        self.epilogue_loop = epilogue_loop
        self.dtype = op.result.dtype
        # Rows past the end exist only when the row count is not known to be whole tiles.
        self.padded = mr > 1 and not (isinstance(rows, tirx.IntImm) and int(rows) % mr == 0)
        # Whether the last row pass runs a remainder tile (``passes``) or the whole tile, padded.
        self.remainder_tiles = self.padded and remainder_tiles
        # With remainder tiles a whole tile's rows are all real: no clamped reads, no guards.
        self.exact = not self.padded or remainder_tiles
        self.stride = mr  # rows per row pass: the row tiles' spacing, also in the k-major copy
        self.remainder = False  # a remainder pass's tile (``remainder_tile``)
        self.packed = None  # the row tiles' activations, k-major (``packed_rows``), if copied
        self.paired_rows = None  # bf16: X's rows as pairs, row-major (``paired_rows``), if copied
        self.in_place_below = None  # remainder tiles of fewer rows read X in place (``with_rows_copied``)
        self.fewer_than = None  # a bound the row count is known to be below (``with_fewer_rows_than``)

    def row_tiles(self):
        return (self.rows + (self.mr - 1)) // self.mr

    def passes(self, i0, groups: int, row_pass, remainder) -> None:
        """The row pass at ``i0`` over a task's ``groups`` register tiles of ``pk`` panels. Where
        ``mr`` rows are left: ``row_pass(tile)``, this tile over every group. Else the shortest
        remainder tile (``remainder_heights``) holding the rows left, widened over several
        groups (``remainder_tile``), inside ``remainder(left)``: a context manager that yields
        the row pass of a remainder tile (its sums left in memory, which it may allocate here,
        on this branch only) and then applies the epilogue to the ``left`` real rows of every
        panel in one loop. The remainder tiles share that one epilogue: a copy in each would
        multiply the build time of a large one, BERT's GELU (TVM's buffer passes grow with the
        code: FlattenBuffer, CompactBufferAllocation). Where the rows are known to be fewer than a
        whole tile (``with_fewer_rows_than``) only the remainder tiles that can hold them are
        emitted."""
        if not self.remainder_tiles:
            row_pass(self)
            return
        left = self.rows - i0
        heights = remainder_heights(self.mr)
        if self.fewer_than is not None and self.fewer_than <= self.mr:
            with remainder(left) as remainder_pass:
                self._remainder_passes(left, heights[:_holding(heights, self.fewer_than - 1) + 1], groups,
                                       remainder_pass)
            return
        with T.If(left >= self.mr):
            with T.Then():
                row_pass(self)
            with T.Else():
                with remainder(left) as remainder_pass:
                    self._remainder_passes(left, heights, groups, remainder_pass)

    def _remainder_passes(self, left, heights: list[int], groups: int, remainder) -> None:
        below = 0
        for height in heights:
            with T.If(tirx.all(left > below, left <= height)):
                with T.Then():
                    remainder(self.remainder_tile(height, groups))
            below = height

    def with_fewer_rows_than(self, bound: int) -> Tile:
        """This tile where the row count is known to be below ``bound`` (at most ``mr``): its
        one row pass is a remainder tile, and the whole tile's code would be dead."""
        tile = copy.copy(self)
        tile.fewer_than = bound
        return tile

    def remainder_tile(self, height: int, groups: int = 1) -> Tile:
        """This tile cut to its first ``height`` rows, for a last pass with fewer rows left:
        its padded rows (past the rows left) read the last real row, in place. It spans as
        many of the task's ``groups`` of ``pk`` panels (``widening``) as keep it within this
        tile's registers: a short tile of one group has too few accumulators to hide the
        multiply-add's latency (AVX2, T = 2 on a 6 x 16 tile: 2 x 16 is 4 chains, where the
        core needs 8)."""
        tile = copy.copy(self)
        tile.mr, tile.exact, tile.remainder = height, height == 1, True
        tile.pk = self.pk * self.widening(height, groups)
        if self.in_place_below is not None and height < self.in_place_below:
            # Rows too few to crowd a set: from X itself, one line per 16 steps a row, not the
            # copy's line a step (the copy's stride is the whole tile's rows).
            tile.packed = None
        return tile

    def widening(self, height: int, groups: int) -> int:
        """The most of ``groups`` (a divisor) a ``height``-row remainder tile spans while its
        registers (``register_footprint``) stay within the whole tile's."""
        vectors = self.pk * self.panel // self.lanes
        budget = register_footprint(self.mr, vectors)
        return max(width for width in range(1, groups + 1)
                   if groups % width == 0 and register_footprint(height, width * vectors) <= budget)

    def with_paired_rows(self, pairs) -> Tile:
        """This bf16 tile reading its rows from ``pairs``, X's rows as pairs (``paired_rows``):
        each row's steps contiguous, so the copy's stores are too."""
        tile = copy.copy(self)
        tile.paired_rows = pairs
        return tile

    def with_rows_copied(self, packed, in_place_below: int | None = None) -> Tile:
        """This tile reading its rows from ``packed``, the k-major copy of ``packed_rows``; its
        remainder tiles of fewer than ``in_place_below`` rows (too few to crowd an L1 set) read
        theirs in place (``remainder_tile``)."""
        tile = copy.copy(self)
        tile.packed = packed
        tile.in_place_below = in_place_below
        return tile

    def finish_rows(self, sums, row0, column0, i0, panel0, count, panels: int | None = None) -> None:
        """The epilogue of ``count`` rows from ``i0``, their sums read from ``sums`` at
        (``row0``, ``column0``): a loop over rows, vectorised along them; with ``panels``, a
        loop over that many panels (the task's), each written as one panel's vectors."""
        with T.serial(0, count) as r:
            def store(p, c):
                column = (panel0 + p) * self.panel + c
                value = sums[row0 + r, column0 + p * self.panel + c]
                T.buffer_store(self.op.out, self.op.finish(value, i0 + r, column), [i0 + r, column])

            if panels is None:
                self.vectors(store, looped=True)
            else:
                with T.serial(0, panels) as p:
                    self.panel_vectors(lambda c: store(p, c), looped=True)

    def row(self, i0, r):
        """The X row tile row ``r`` reads: a padded row repeats the last real one."""
        return i0 + r if self.exact else self.clamped_row(i0, r)

    def clamped_row(self, i0, r):
        """Row ``i0 + r`` of X, or its last row where the tile may run past it."""
        return tirx.min(i0 + r, self.rows - 1) if self.padded and r else i0 + r

    def accumulators(self) -> list:
        """Per row, one buffer per panel (``acc[r][p]``, ``panel`` values): TVM makes a buffer
        of at most 1 KB a stack alloca (``kMaxStackAlloca``), which LLVM keeps in vector
        registers, and a larger one a workspace it keeps in memory (a widened remainder tile's
        one buffer would then store every accumulator every step)."""
        # Scope "global": LLVM kept "local" buffers in memory once the loop held prefetches.
        return [[T.alloc_buffer((self.panel,), self.dtype, scope="global") for _ in range(self.pk)]
                for _ in range(self.mr)]

    def vectors(self, body, looped: bool = False) -> None:
        """``body(p, offset)`` for every vector of the tile row (``offset``: its lanes within
        panel p; see ``panel_vectors``)."""
        for p in range(self.pk):
            self.panel_vectors(lambda offset, p=p: body(p, offset), looped)

    def panel_vectors(self, body, looped: bool = False) -> None:
        """``body(offset)`` for every vector of one panel, ``offset`` its lanes within the panel:
        one vector index (a ``Ramp``), or with ``looped`` the variable of a vectorised loop over
        them (for the epilogue, whose scalar expressions TVM's vectoriser makes vector: BERT's
        GELU calls functions the IR builder would have to retype). TVM's FlattenBuffer simplifies
        every index against every loop variable the function has met before it, so a loop per
        vector would make the tile's build quadratic in its size."""
        for v in range(self.panel // self.lanes):
            if looped:
                with T.vectorized(0, self.lanes) as lane:
                    body(v * self.lanes + lane)
            else:
                body(tirx.Ramp(tirx.const(v * self.lanes, "int32"), tirx.const(1, "int32"), self.lanes))

    def zero(self, accs) -> None:
        zero = tirx.const(0, self.dtype)
        for acc in accs:
            self.vectors(lambda p, c, acc=acc: T.buffer_store(acc[p], tirx.Broadcast(zero, self.lanes), [c]))

    def load(self, accs, partial, i0, column0) -> None:
        for r, acc in enumerate(accs):
            self.vectors(lambda p, c, r=r, acc=acc: T.buffer_store(
                acc[p], partial[i0 + r, column0 + p * self.panel + c], [c]))

    def save(self, accs, partial, i0, column0) -> None:
        for r, acc in enumerate(accs):
            self.vectors(lambda p, c, r=r, acc=acc: T.buffer_store(
                partial, acc[p][c], [i0 + r, column0 + p * self.panel + c]))

    def multiply_add(self, accs, i0, panel0, k) -> None:
        for r, acc in enumerate(accs):
            row = self.row(i0, r)
            if self.paired_rows is not None:
                x = self.paired_rows[row * self.op.extents[3] + k]
            else:
                x = None if self.packed is None else self.packed[i0 * self.op.extents[3] + k * self.stride + r]
            if self.op.bf16:  # (its rows are always copied as pairs first: ``kernel.py``)
                self.vectors(lambda p, c, acc=acc, x=x: T.buffer_store(
                    acc[p], bf16.dot_pairs(acc[p][c], x, self.op.weight[panel0 + p, k, c]), [c]))
                continue
            self.vectors(lambda p, c, acc=acc, row=row, x=x: T.buffer_store(
                acc[p], acc[p][c] + self.op.term(row, panel0 + p, c, k, x), [c]))

    def finish(self, accs, i0, panel0, sums, row0, column0) -> None:
        """The epilogue of each real row, stored once: a padded row is never written. With
        ``epilogue_loop`` the sums go to ``sums`` at (``row0``, ``column0``) first and the
        epilogue runs in a loop over the rows (``finish_rows``), its code written once."""
        if self.epilogue_loop:
            self.save(accs, sums, row0, column0)
            real = self.mr if self.exact else tirx.min(self.mr, self.rows - i0)
            self.finish_rows(sums, row0, column0, i0, panel0, real)
            return
        for r, acc in enumerate(accs):
            def store(p, c, r=r, acc=acc):
                column = (panel0 + p) * self.panel + c
                T.buffer_store(self.op.out, self.op.finish(acc[p][c], i0 + r, column),
                               [i0 + r, column])

            if not self.exact and r:
                with T.If(i0 + r < self.rows):
                    with T.Then():
                        self.vectors(store, looped=True)
            else:
                self.vectors(store, looped=True)
