"""The CPU GEMM micro-kernel on packed weights: the loop nest of a BLAS sgemm, for every T.

The operator reads its weight as ``Wp[N / P, K, P]`` (``packing.py``), so one register tile
streams a contiguous panel. The kernel is emitted with the IR builder from the operator's own
product and epilogue expressions (as ``cpu_clamped.py`` does), not scheduled from its blocks:

    parallel over (task: nb panels x mr rows):
        for each group of pk panels:                 the register tile: mr x (pk * P)
            acc[r] = 0, one small buffer per row     (each row's vectors: values LLVM keeps
            for k in K:                               in registers)
                for r, p, v: acc[r][p, v] += X[row(r), k] * Wp[panel + p, k, v]
            for r: if row r is real: out[row, cols] = epilogue(acc[r])   stored once, vectorised

A symbolic row count is padded to whole ``mr`` tiles *locally*: a padded row reads the last
real row of X (``min(i0 + r, T - 1)``, loop-invariant in k) and its results are never stored,
so no copy of the activations is made and the inner loop is the same straight-line code for
every T. Against the scheduled form this replaced (a padded copy of X, one accumulator buffer
for the whole tile), the same tiles ran 9-11% faster geomean (0.99-1.6x per point: five tiles of
the 3072 -> 768 layer at T = 1..512, znver4, weights cached or streamed), and bert-base with the
same plans 4-7% faster end to end (README, Benchmarks).

With ``kc`` < K (the reduction in blocks, BLIS order) a task is ``nb`` panels over all rows: a
``kc``-deep block of its panels stays in L2 while every row tile passes over it, and partial
sums wait in the task's workspace between blocks; the last block applies the epilogue from
the registers.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from .matching import ScheduleMismatch
from .microkernel import MicroKernel
from .tir_rebuild import MatmulExpressions, rebuild


def packed_tile(kernel: MicroKernel) -> tuple[int, int, int, int]:
    """(mr, panel, panels per register tile, panels per task) of a packed micro-kernel."""
    (mr,) = kernel.tile_sizes("i")
    panel, pk, groups = kernel.tile_sizes("j")
    return mr, panel, pk, pk * groups


class _PackedOperator(MatmulExpressions):
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

    def term(self, row, panel, lane, k) -> tirx.Expr:
        return rebuild(self.product, dict(zip(self.iter_vars, [row, panel, lane, k], strict=True)))

    def finish(self, value, row, column) -> tirx.Expr:
        return rebuild(self.epilogue, dict(zip(self.out_vars, [row, column], strict=True)), {self.result: value})


def apply_cpu_packed(func: tirx.PrimFunc, kernel: MicroKernel) -> tirx.PrimFunc:
    """``func`` (already reading its weight packed, ``pack_prim_func``) as ``kernel``'s loop nest."""
    mr, panel, pk, nb = packed_tile(kernel)
    lanes = kernel.vector
    if panel % lanes:
        raise ScheduleMismatch(f"panel width {panel} is not a whole number of {lanes}-lane vectors")
    op = _PackedOperator(func)
    rows, panels, width, depth = op.extents
    if not isinstance(width, tirx.IntImm) or int(width) != panel or not isinstance(panels, tirx.IntImm) \
            or int(panels) % nb:
        raise ScheduleMismatch(f"weight packing does not fit {nb} panels of {panel} per task")
    kc = kernel.tile_sizes("k")[0]
    blocked = isinstance(depth, tirx.IntImm) and 1 < kc < int(depth)
    if blocked and int(depth) % kc:
        raise ScheduleMismatch(f"reduction of {depth} is not a whole number of {kc}-deep blocks")
    tile = _Tile(op, mr, panel, pk, lanes, rows)
    loop = T.parallel if kernel.threads != 1 else T.serial
    with IRBuilder() as builder:
        if blocked:
            _blocked_reduction(tile, loop, int(panels) // nb, nb, depth, kc)
        else:
            _whole_reduction(tile, loop, int(panels) // nb, nb, depth)
    return func.with_body(builder.get()).with_attr("tirx.is_scheduled", True)


class _Tile:
    """One ``mr x (pk * panel)`` register tile's code: accumulators, FMAs, stores."""

    def __init__(self, op: _PackedOperator, mr: int, panel: int, pk: int, lanes: int, rows):
        self.op, self.mr, self.panel, self.pk, self.lanes, self.rows = op, mr, panel, pk, lanes, rows
        self.dtype = op.result.dtype
        # Rows past the end exist only when the row count is not known to be whole tiles.
        self.padded = mr > 1 and not (isinstance(rows, tirx.IntImm) and int(rows) % mr == 0)

    def row(self, i0, r):
        """The X row tile row ``r`` reads: a padded row repeats the last real one."""
        return tirx.min(i0 + r, self.rows - 1) if self.padded and r else i0 + r

    def accumulators(self) -> list:
        return [T.alloc_buffer((self.pk * self.panel,), self.dtype, scope="local") for _ in range(self.mr)]

    def vectors(self, body) -> None:
        """``body(p, offset)`` for every vector of the tile row: offset = lanes within panel p."""
        for p in range(self.pk):
            for v in range(self.panel // self.lanes):
                with T.vectorized(0, self.lanes) as lane:
                    body(p, v * self.lanes + lane)

    def zero(self, accs) -> None:
        zero = tirx.const(0, self.dtype)
        for acc in accs:
            self.vectors(lambda p, c, acc=acc: T.buffer_store(acc, zero, [p * self.panel + c]))

    def load(self, accs, partial, i0, column0) -> None:
        for r, acc in enumerate(accs):
            self.vectors(lambda p, c, r=r, acc=acc: T.buffer_store(
                acc, partial[i0 + r, column0 + p * self.panel + c], [p * self.panel + c]))

    def save(self, accs, partial, i0, column0) -> None:
        for r, acc in enumerate(accs):
            self.vectors(lambda p, c, r=r, acc=acc: T.buffer_store(
                partial, acc[p * self.panel + c], [i0 + r, column0 + p * self.panel + c]))

    def multiply_add(self, accs, i0, panel0, k) -> None:
        for r, acc in enumerate(accs):
            row = self.row(i0, r)
            self.vectors(lambda p, c, acc=acc, row=row: T.buffer_store(
                acc, acc[p * self.panel + c] + self.op.term(row, panel0 + p, c, k), [p * self.panel + c]))

    def finish(self, accs, i0, panel0) -> None:
        """The epilogue of each real row, stored once: a padded row is never written."""
        for r, acc in enumerate(accs):
            def store(p, c, r=r, acc=acc):
                column = (panel0 + p) * self.panel + c
                T.buffer_store(self.op.out, self.op.finish(acc[p * self.panel + c], i0 + r, column),
                               [i0 + r, column])

            if self.padded and r:
                with T.If(i0 + r < self.rows):
                    with T.Then():
                        self.vectors(store)
            else:
                self.vectors(store)


def _whole_reduction(tile: _Tile, loop, blocks: int, nb: int, depth) -> None:
    row_tiles = (tile.rows + (tile.mr - 1)) // tile.mr
    with loop(0, blocks * row_tiles) as task:
        first_panel = task // row_tiles * nb
        i0 = task % row_tiles * tile.mr
        with T.serial(0, nb // tile.pk) as group:
            panel0 = first_panel + group * tile.pk
            accs = tile.accumulators()
            tile.zero(accs)
            with T.serial(0, depth) as k:
                tile.multiply_add(accs, i0, panel0, k)
            tile.finish(accs, i0, panel0)


def _blocked_reduction(tile: _Tile, loop, blocks: int, nb: int, depth, kc: int) -> None:
    row_tiles = (tile.rows + (tile.mr - 1)) // tile.mr
    last = int(depth) // kc - 1
    with loop(0, blocks) as task:
        partial = T.alloc_buffer((row_tiles * tile.mr, nb * tile.panel), tile.dtype)
        with T.serial(0, last + 1) as ko:
            with T.serial(0, row_tiles) as it:
                i0 = it * tile.mr
                with T.serial(0, nb // tile.pk) as group:
                    panel0 = task * nb + group * tile.pk
                    column0 = group * tile.pk * tile.panel
                    accs = tile.accumulators()
                    with T.If(ko == 0):
                        with T.Then():
                            tile.zero(accs)
                        with T.Else():
                            tile.load(accs, partial, i0, column0)
                    with T.serial(0, kc) as kk:
                        tile.multiply_add(accs, i0, panel0, ko * kc + kk)
                    with T.If(ko == last):
                        with T.Then():
                            tile.finish(accs, i0, panel0)
                        with T.Else():
                            tile.save(accs, partial, i0, column0)


__all__ = ["apply_cpu_packed", "packed_tile"]
