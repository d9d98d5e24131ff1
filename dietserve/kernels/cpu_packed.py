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

A row count that is not whole ``mr`` tiles ends in a *remainder tile*: the last row pass runs
the shortest of a few shorter copies of the tile (``remainder_heights``: 1, 2, 4, 7, 10 rows)
that holds the rows left, chosen by a branch per pass, as a BLAS library's edge kernels are;
its few padded rows read the last real row of X (``min(i0 + r, T - 1)``, loop-invariant in k)
and the epilogue runs on the real rows only, in a loop after it. So a short shape passes over
the weight once, on a tile at most a third padding. Built without them (``REMAINDER_TILES``),
the last pass computes the whole tile, its padded rows never stored.

With ``kc`` < K (the reduction in blocks, BLIS order) a task is ``nb`` panels over all rows: a
``kc``-deep block of its panels stays in L2 while every row tile passes over it, and partial
sums wait in the task's workspace between blocks; the last block applies the epilogue from
the registers. Where a task has enough row passes, the ones after its first also prefetch the
weight block it reads next, one cache line per reduction step (``_NextBlock``).

A tile whose rows would crowd one L1 set (``crowding_rows``: a row stride of a multiple of
4 KB, more rows than the set's ways, and at least as many rows to compute) reads its rows from
a k-major copy made first, in parallel (``_packed_rows``; the padded rows again repeat the last
real one): each step's broadcasts then come from one line.
"""

from __future__ import annotations

import copy
import math
from collections import Counter

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from .matching import ScheduleMismatch
from .microkernel import MicroKernel
from .tir_rebuild import MatmulExpressions, rebuild

# The first row tile of a task reads the task's weight block from DRAM (in the served model no
# cache holds the weights) while it computes a fraction of the task's FMAs; the later row tiles
# compute from the cache while the memory bus idles. So the later tiles prefetch the task's next
# block, spread over them (``_NextBlock``). bert-base, the same plans built with and without,
# interleaved (``compare_artifacts.py``, znver4): seq 31 1.07-1.08x, 48 1.04-1.05x, 64
# 1.01-1.02x, other lengths within the machine's noise; hot, the kernels time as before.
PREFETCH_NEXT_BLOCK = True
CACHE_LINE_BYTES = 64
# A register tile broadcasts one element of each of its rows per reduction step. Where the rows'
# stride is a multiple of 4 KB (K = 1024, 3072 floats) they all fall in one L1 set (x86 L1 data
# caches index within a 4 KB page: 64 sets of 64-byte lines), and a tile taller than the set's
# ways evicts its own rows every step. Such tiles read a k-major copy of their rows instead
# (``_packed_rows``): one line holds a step's broadcasts. bert-base's 3072 -> 768 layer, forced
# 13-row tile, weight in cache / from DRAM (``cold_weights.py --without row-copy``, znver4):
# 1.14x / 1.52x at T = 13, 1.12-1.27x / 1.08-1.39x at T = 16-512. Tiles of 4-8 rows there ran
# 0.85-1.01x hot with the copy, and 768-deep layers' (4 sets) 0.91-0.96x: it is made only where rows crowd a set
# (``crowding_rows``), and only for row counts that fill that many of the tile's rows.
PACK_ROWS = True
L1_SET_SPAN_BYTES = 4096
L1_WAYS = 8  # the fewest of the x86 cores in view (AMD Zen: 32 KB, 8 ways; Intel: 48 KB, 12)
PACK_CHUNK = 256  # reduction steps per job of the copy
# The last row pass of a tile that does not divide T runs a tile of the rows left instead of
# computing padded rows (``_Tile.passes``): T = 11 on a 9-row tile computes 11 rows, not 18.
REMAINDER_TILES = True
REMAINDER_LADDER = (1, 2, 4, 7, 10)


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
        weights, others = [], []
        rebuild(self.product, {}, on_load=lambda load: (weights if len(load.indices) == 3 else others).append(load))
        if len(weights) != 1:
            raise ScheduleMismatch("expected the product to read one packed weight [panels, K, panel]")
        self.weight = weights[0].source
        # The activation X[row, k], when the product reads one: what ``_packed_rows`` copies.
        self.activation = others[0] if len(others) == 1 and len(others[0].indices) == 2 else None
        # The weight as one array, for the prefetches: their addresses then step by a constant.
        size = math.prod(int(extent) for extent in self.weight.shape)
        self.flat_weight = tirx.decl_buffer((size,), self.weight.dtype, "weight_flat", data=self.weight.data)

    def term(self, row, panel, lane, k, activation=None) -> tirx.Expr:
        """The product at (row, panel, lane, k); ``activation``: X[row, k] read from elsewhere."""
        loads = {} if activation is None else {self.activation.source: activation}
        return rebuild(self.product, dict(zip(self.iter_vars, [row, panel, lane, k], strict=True)), loads)

    def activation_at(self, row, k) -> tirx.Expr:
        return rebuild(self.activation, {self.iter_vars[0]: row, self.iter_vars[3]: k})

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
    crowding = crowding_rows(mr, int(depth) * op.activation.source.dtype.bits // 8) \
        if PACK_ROWS and op.activation is not None and isinstance(depth, tirx.IntImm) else None

    def reduction(tile: _Tile) -> None:
        if blocked:
            _blocked_reduction(tile, loop, int(panels) // nb, nb, depth, kc)
        else:
            _whole_reduction(tile, loop, int(panels) // nb, nb, depth)

    with IRBuilder() as builder, T.seq_scope():
        if crowding is None:
            reduction(tile)
        else:
            # With fewer rows the tile's padded rows read the last real one again: they crowd
            # no set, and the copy would only cost (T = 7 on a 9-row tile: 2-7% slower with it).
            with T.If(rows >= crowding):
                with T.Then():
                    copying = copy.copy(tile)
                    copying.packed = _packed_rows(tile, loop, int(depth))
                    reduction(copying)
                with T.Else():
                    reduction(tile)
    body = builder.get().body  # (inside seq_scope's frame, which only let two loops follow each other)
    if PREFETCH_NEXT_BLOCK:
        body = tirx.SeqStmt([tirx.DeclBuffer(op.flat_weight, data=op.weight.data), body])
    return func.with_body(body).with_attr("tirx.is_scheduled", True)


def remainder_heights(mr: int) -> list[int]:
    """The remainder tiles of an ``mr``-row tile, shortest first: the rows left (1 .. mr - 1)
    run on the shortest that holds them (``mr`` itself, padded, past the ladder's tallest), so
    at most a third of its rows are padding."""
    return [height for height in REMAINDER_LADDER if height < mr] + [mr]


def computed_extent(kernel: MicroKernel, axis: str, extent: int) -> int:
    """How much of ``axis`` ``kernel`` computes for a shape ``extent`` long, padding included:
    whole tiles, but a packed kernel's rows end in a remainder tile (``remainder_heights``)."""
    tile = kernel.tile_of(axis)
    if not (kernel.pack and axis == "i" and REMAINDER_TILES) or extent % tile == 0:
        return -(-extent // tile) * tile
    left = extent % tile
    return extent - left + next(height for height in remainder_heights(tile) if height >= left)


def crowding_rows(mr: int, row_bytes: int) -> int | None:
    """The fewest of an ``mr``-row tile's rows, ``row_bytes`` apart, of which more share one L1
    set than it has ways (``L1_WAYS``); None where its rows never crowd a set."""
    sets: Counter = Counter()
    for r in range(mr):
        line = r * row_bytes % L1_SET_SPAN_BYTES // CACHE_LINE_BYTES
        sets[line] += 1
        if sets[line] > L1_WAYS:
            return r + 1
    return None


class _Tile:
    """One ``mr x (pk * panel)`` register tile's code: accumulators, FMAs, stores."""

    def __init__(self, op: _PackedOperator, mr: int, panel: int, pk: int, lanes: int, rows):
        self.op, self.mr, self.panel, self.pk, self.lanes, self.rows = op, mr, panel, pk, lanes, rows
        self.dtype = op.result.dtype
        # Rows past the end exist only when the row count is not known to be whole tiles.
        self.padded = mr > 1 and not (isinstance(rows, tirx.IntImm) and int(rows) % mr == 0)
        # With remainder tiles a whole tile's rows are all real: no clamped reads, no guards.
        self.exact = not self.padded or REMAINDER_TILES
        self.stride = mr  # rows per row pass: the row tiles' spacing, also in the k-major copy
        self.remainder = False  # a remainder pass's tile (``passes``)
        self.packed = None  # the row tiles' activations, k-major (``_packed_rows``), if copied

    def row_tiles(self):
        return (self.rows + (self.mr - 1)) // self.mr

    def passes(self, i0, whole, remainder, finish_remainder) -> None:
        """The row pass at ``i0``. Where ``mr`` rows are left: ``whole(tile, accumulators)``,
        this tile. Else the shortest remainder tile (``remainder_heights``) holding the rows
        left, ``remainder(tile, accumulators)``, which leaves its sums in memory, then
        ``finish_remainder(left)`` applies the epilogue to the ``left`` real rows in one loop.
        All share this tile's accumulators, and the remainder tiles one epilogue: with the
        epilogue in each, BERT's GELU layer built 2.5x slower (TVM's buffer passes grow with
        the code: FlattenBuffer, CompactBufferAllocation)."""
        accs = self.accumulators()
        if not (self.padded and REMAINDER_TILES):
            whole(self, accs)
            return
        left = self.rows - i0
        with T.If(left >= self.mr):
            with T.Then():
                whole(self, accs)
            with T.Else():
                below = 0
                for height in remainder_heights(self.mr):
                    with T.If(tirx.all(left > below, left <= height)):
                        with T.Then():
                            tile = copy.copy(self)
                            # its padded rows (past ``left``) read the last real row, in place
                            tile.mr, tile.exact, tile.remainder = height, height == 1, True
                            remainder(tile, accs[:height])
                    below = height
                finish_remainder(left)

    def finish_rows(self, sums, row0, column0, i0, panel0, count) -> None:
        """The epilogue of ``count`` rows from ``i0``, their sums read from ``sums`` at
        (``row0``, ``column0``): a loop over rows, vectorised along them."""
        with T.serial(0, count) as r:
            def store(p, c):
                column = (panel0 + p) * self.panel + c
                value = sums[row0 + r, column0 + p * self.panel + c]
                T.buffer_store(self.op.out, self.op.finish(value, i0 + r, column), [i0 + r, column])

            self.vectors(store)

    def row(self, i0, r):
        """The X row tile row ``r`` reads: a padded row repeats the last real one."""
        return i0 + r if self.exact else self.clamped_row(i0, r)

    def clamped_row(self, i0, r):
        """Row ``i0 + r`` of X, or its last row where the tile may run past it."""
        return tirx.min(i0 + r, self.rows - 1) if self.padded and r else i0 + r

    def accumulators(self) -> list:
        # Scope "global": TVM makes such small buffers stack allocas, which LLVM keeps in vector
        # registers with the prefetches in the loop; "local" ones it then kept in memory (the
        # 3072 -> 768 layer at T = 31 ran 2.7x slower).
        return [T.alloc_buffer((self.pk * self.panel,), self.dtype, scope="global") for _ in range(self.mr)]

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
            x = None if self.packed is None else self.packed[i0 * self.op.extents[3] + k * self.stride + r]
            self.vectors(lambda p, c, acc=acc, row=row, x=x: T.buffer_store(
                acc, acc[p * self.panel + c] + self.op.term(row, panel0 + p, c, k, x), [p * self.panel + c]))

    def finish(self, accs, i0, panel0) -> None:
        """The epilogue of each real row, stored once: a padded row is never written."""
        for r, acc in enumerate(accs):
            def store(p, c, r=r, acc=acc):
                column = (panel0 + p) * self.panel + c
                T.buffer_store(self.op.out, self.op.finish(acc[p * self.panel + c], i0 + r, column),
                               [i0 + r, column])

            if not self.exact and r:
                with T.If(i0 + r < self.rows):
                    with T.Then():
                        self.vectors(store)
            else:
                self.vectors(store)


def _packed_rows(tile: _Tile, loop, depth: int):
    """X's rows copied per row tile, k-major: row ``r`` of the tile at ``i0``, step ``k``, at
    ``i0 * depth + k * mr + r`` (padded rows repeat the last real one)."""
    row_tiles = tile.row_tiles()
    chunk = math.gcd(depth, PACK_CHUNK)
    chunks = depth // chunk
    packed = T.alloc_buffer((row_tiles * tile.mr * depth,), tile.op.activation.source.dtype)
    with loop(0, row_tiles * chunks) as job:
        i0, k0 = job // chunks * tile.mr, job % chunks * chunk
        for r in range(tile.mr):
            with T.serial(0, chunk) as kk:
                T.buffer_store(packed, tile.op.activation_at(tile.clamped_row(i0, r), k0 + kk),
                               [i0 * depth + (k0 + kk) * tile.mr + r])
    return packed


def _reduce(tile: _Tile, accs, i0, panel0, k_first, extent, ahead: _NextBlock | None = None, unit=0) -> None:
    """``accs`` += the tile's products over reduction steps ``k_first`` .. ``+ extent - 1``;
    with ``ahead``, step ``kk`` also fetches a line of the next block (``_NextBlock.prefetch``)."""
    with T.serial(0, extent) as kk:
        tile.multiply_add(accs, i0, panel0, k_first + kk)
        if ahead is not None:
            ahead.prefetch(unit, kk)


class _NextBlock:
    """The weight block a task reads next (``panels`` panels from ``first_panel``, reduction
    steps ``k0`` .. ``+ span - 1``), fetched while the task's later row passes compute on the
    current one, one line per step.

    A panel's part of the block is a contiguous run of ``per_run`` x ``span`` lines. The
    (pass, register tile) units of the later passes take a panel's run ``span`` lines at a
    time, in order: unit ``u`` fetches lines ``(u % per_run) * span`` .. ``+ span - 1`` of
    panel ``u // per_run``, so in the FMA loop the address steps by a line (the division is
    per unit). Over the whole reduction that is the block in memory order, one stream.

    Only where those units are enough for the block (``enough``): a row tile reads
    ``per_step`` lines a step, so that takes ``per_step`` passes after the first. Fetching
    faster, to cover the block in fewer passes, ran slower than not fetching at all (bert-base
    seq 13 and 20 at 0.89x and 0.92x end to end): the stream then competes with the current
    block's loads."""

    def __init__(self, tile: _Tile, row_tiles, first_panel, panels: int, k0, span: int, depth: int):
        self.tile, self.row_tiles, self.first_panel, self.panels, self.k0, self.span, self.depth = \
            tile, row_tiles, first_panel, panels, k0, span, depth
        self.line = CACHE_LINE_BYTES // (tile.dtype.bits // 8)  # elements per cache line
        self.per_run = -(-tile.panel // self.line)  # lines per step of one panel
        self.run_lines = -(-span * tile.panel // self.line)
        self.per_step = tile.pk * self.per_run

    def enough(self) -> tirx.Expr:
        return self.row_tiles - 1 >= self.per_step

    def prefetch(self, unit, step) -> None:
        """Line ``step`` of ``unit``'s share (past the block's end: a line of its last run)."""
        panel = tirx.min(unit // self.per_run, self.panels - 1)
        line = tirx.min(unit % self.per_run * self.span + step, self.run_lines - 1)
        element = ((self.first_panel + panel) * self.depth + self.k0) * self.tile.panel + line * self.line
        # (address, read, keep in every cache level, data cache)
        T.evaluate(tirx.call_llvm_intrin("void", "llvm.prefetch.p0",
                                         T.address_of(self.tile.op.flat_weight[element]), 0, 3, 1))


def _reduce_fetching(tile: _Tile, accs, i0, panel0, k_first, extent, ahead: _NextBlock, when, unit) -> None:
    """The reduction, also fetching ``ahead`` where ``when`` holds (a row pass after the
    task's first, with a next block) and its units are enough for the block."""
    if not PREFETCH_NEXT_BLOCK or tile.remainder:
        # (a remainder pass leaves its share of the block to the hardware: its own copy of the
        # loop with the prefetches would add as much code again to every kernel)
        _reduce(tile, accs, i0, panel0, k_first, extent)
        return
    with T.If(tirx.all(when, ahead.enough())):
        with T.Then():
            _reduce(tile, accs, i0, panel0, k_first, extent, ahead, unit)
        with T.Else():
            _reduce(tile, accs, i0, panel0, k_first, extent)


def _whole_reduction(tile: _Tile, loop, blocks: int, nb: int, depth) -> None:
    row_tiles = tile.row_tiles()
    groups = nb // tile.pk
    with loop(0, blocks * row_tiles) as task:
        block, it = task // row_tiles, task % row_tiles
        with T.serial(0, groups) as group:
            panel0 = block * nb + group * tile.pk

            i0 = it * tile.mr

            def reduce(tile: _Tile, accs: list) -> None:
                tile.zero(accs)
                _reduce_fetching(tile, accs, i0, panel0, 0, depth,
                                 _NextBlock(tile, row_tiles, block * nb + nb, nb, 0, int(depth), int(depth)),
                                 tirx.all(it >= 1, block + 1 < blocks), (it - 1) * groups + group)

            def whole(tile: _Tile, accs: list) -> None:
                reduce(tile, accs)
                tile.finish(accs, i0, panel0)

            # a remainder tile's sums, for the epilogue loop (scope "global": a stack array)
            sums = T.alloc_buffer((tile.mr, tile.pk * tile.panel), tile.dtype, scope="global") \
                if tile.padded and REMAINDER_TILES else None

            def remainder(tile: _Tile, accs: list) -> None:
                reduce(tile, accs)
                tile.save(accs, sums, 0, 0)

            tile.passes(i0, whole, remainder, lambda left: tile.finish_rows(sums, 0, 0, i0, panel0, left))


def _blocked_reduction(tile: _Tile, loop, blocks: int, nb: int, depth, kc: int) -> None:
    row_tiles = tile.row_tiles()
    last = int(depth) // kc - 1
    groups = nb // tile.pk
    with loop(0, blocks) as task:
        partial = T.alloc_buffer((row_tiles * tile.mr, nb * tile.panel), tile.dtype)
        with T.serial(0, last + 1) as ko:
            with T.serial(0, row_tiles) as it:
                with T.serial(0, groups) as group:
                    panel0 = task * nb + group * tile.pk
                    column0 = group * tile.pk * tile.panel

                    i0 = it * tile.mr

                    def reduce(tile: _Tile, accs: list) -> None:
                        with T.If(ko == 0):
                            with T.Then():
                                tile.zero(accs)
                            with T.Else():
                                tile.load(accs, partial, i0, column0)
                        # Next: this task's next reduction block, or after its last the next task's first.
                        ahead = _NextBlock(tile, row_tiles, tirx.Select(ko < last, task * nb, task * nb + nb), nb,
                                           tirx.Select(ko < last, ko * kc + kc, 0), kc, int(depth))
                        _reduce_fetching(tile, accs, i0, panel0, ko * kc, kc, ahead,
                                         tirx.all(it >= 1, tirx.any(ko < last, task + 1 < blocks)),
                                         (it - 1) * groups + group)

                    def whole(tile: _Tile, accs: list) -> None:
                        reduce(tile, accs)
                        with T.If(ko == last):
                            with T.Then():
                                tile.finish(accs, i0, panel0)
                            with T.Else():
                                tile.save(accs, partial, i0, column0)

                    def remainder(tile: _Tile, accs: list) -> None:
                        reduce(tile, accs)
                        tile.save(accs, partial, i0, column0)  # (the partial sums hold whole tiles)

                    def finish_remainder(left) -> None:
                        with T.If(ko == last):
                            with T.Then():
                                tile.finish_rows(partial, i0, column0, i0, panel0, left)

                    tile.passes(i0, whole, remainder, finish_remainder)


__all__ = ["apply_cpu_packed", "computed_extent", "crowding_rows", "packed_tile", "remainder_heights"]
