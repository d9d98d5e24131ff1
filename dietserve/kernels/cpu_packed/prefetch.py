"""Prefetching a packed GEMM's weight (``kernel.py``): the block a task reads next, spread
over the task's later row passes, one cache line per reduction step (``NextBlock``); and, in
the passes that fetch no next block, the lines a fixed distance ahead of those each step reads
(``stream_ahead``)."""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from .tile import Tile

CACHE_LINE_BYTES = 64
MAX_SPREAD_LOG2 = 3  # a spread next block takes at most 8 times as many passes (``NextBlock``)


class NextBlock:
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
    faster, to cover the block in fewer passes, costs more than it saves: the stream then
    competes with the current block's loads.

    Where there are at least twice as many later passes (``spread``), each unit's share is
    fetched by 2, 4 or 8 units in turn, a line every 2, 4 or 8 steps: at a line a step the
    first few passes would fetch the whole block faster than one core's share of the DRAM
    delivers it, and the rest would fetch nothing (``PackedSettings.spread_next_block``)."""

    def __init__(self, tile: Tile, row_tiles, first_panel, panels: int, k0, span: int, depth: int,
                 spread: bool = False):
        self.tile, self.row_tiles, self.first_panel, self.panels, self.k0, self.span, self.depth = \
            tile, row_tiles, first_panel, panels, k0, span, depth
        self.line = line_elements(tile)
        self.per_run = -(-tile.panel // self.line)  # lines per step of one panel
        self.run_lines = -(-span * tile.panel // self.line)
        self.per_step = tile.pk * self.per_run
        # log2 of the passes each share is spread over (``spread``): the later passes over the
        # passes the block needs at a line a step, rounded down to a power of two, at most
        # 2 ** MAX_SPREAD_LOG2: a shift, not a division, in the FMA loop.
        self.shift = 0
        if spread:
            ratio = (row_tiles - 1) // self.per_step
            self.shift = sum(tirx.Select(ratio >= 1 << s, 1, 0) for s in range(1, MAX_SPREAD_LOG2 + 1))

    def enough(self) -> tirx.Expr:
        return self.row_tiles - 1 >= self.per_step

    def fetched(self, unit, step) -> tuple:
        """(panel of the block, line of its run) that ``unit`` fetches at reduction step ``step``:
        line ``step`` of its share (past the block's end: a line of its last run); spread, a
        share of ``span`` lines is fetched by ``2 ** shift`` units in turn, each taking a line
        every ``2 ** shift`` steps."""
        if isinstance(self.shift, int) and self.shift == 0:
            share, offset = unit, step
        else:
            share = tirx.shift_right(unit, self.shift)
            part = unit - tirx.shift_left(share, self.shift)
            offset = tirx.shift_right(part * self.span + step, self.shift)
        panel = tirx.min(share // self.per_run, self.panels - 1)
        return panel, tirx.min(share % self.per_run * self.span + offset, self.run_lines - 1)

    def prefetch(self, unit, step) -> None:
        panel, line = self.fetched(unit, step)
        element = ((self.first_panel + panel) * self.depth + self.k0) * self.tile.panel + line * self.line
        prefetch(self.tile, element)


def stream_ahead(tile: Tile, panel0, k, distance: int) -> None:
    """At reduction step ``k`` of the register tile at panel ``panel0``: each of the lines the
    step reads, ``distance`` bytes further on in its panel's run (past the run's end: the next
    panel's first lines, the ones the task reads next). The address is the load's plus a
    constant, so it costs no register; past the weight's end it is not clamped (a compare per
    line, and the registers it holds, spilled AVX2 tiles): a prefetch never faults."""
    line = line_elements(tile)
    ahead = distance // (tile.dtype.bits // 8)
    depth = tile.op.extents[3]
    for p in range(tile.pk):
        for j in range(-(-tile.panel // line)):
            prefetch(tile, ((panel0 + p) * depth + k) * tile.panel + j * line + ahead)


def line_elements(tile: Tile) -> int:
    """The weight's elements in one cache line."""
    return CACHE_LINE_BYTES // (tile.dtype.bits // 8)


def prefetch(tile: Tile, element) -> None:
    """Fetch the cache line of the tile's flat weight at ``element`` into every cache level."""
    # (address, read, keep in every cache level, data cache)
    T.evaluate(tirx.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(tile.op.flat_weight[element]), 0, 3, 1))
