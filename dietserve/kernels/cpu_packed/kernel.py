"""The CPU GEMM micro-kernel on packed weights: the loop nest of a BLAS sgemm, for every T.

The operator reads its weight as ``Wp[N / P, K, P]`` (``packing.py``), so one register tile
streams a contiguous panel. The kernel is emitted with the IR builder from the operator's own
product and epilogue expressions (as ``cpu_clamped.py`` does), not scheduled from its blocks:

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
most a third padding, at the FMA rate. Built without them (``REMAINDER_TILES``), the last pass
computes the whole tile, its padded rows never stored.

With ``kc`` < K (the reduction in blocks, BLIS order) a task is ``nb`` panels over all rows: a
``kc``-deep block of its panels stays in L2 while every row tile passes over it, and partial
sums wait in the task's workspace between blocks; the last block applies the epilogue from
the registers. Where a task has enough row passes, the ones after its first also prefetch the
weight block it reads next, one cache line per reduction step (``NextBlock``).

A tile whose rows would crowd one L1 set (``crowding_rows``: a row stride of a multiple of
4 KB, more rows than the set's ways, and at least as many rows to compute) reads its rows from
a k-major copy made first, in parallel (``packed_rows``; the padded rows again repeat the last
real one): each step's broadcasts then come from one line. Its remainder tiles too short to
crowd a set read their rows in place (``REMAINDER_ROWS_IN_PLACE``).

The parts: ``packed_tile`` (the operator's expressions, the register tile and its remainder
tiles), ``packed_loops`` (the two reduction loop nests, the row copy), ``packed_prefetch``
(``NextBlock``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from functools import partial

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from ..plan.microkernel import MicroKernel
from ..tir.build import with_exact_buffers
from ..tir.matching import ScheduleMismatch
from ..tir.rebuild import expression_size
from .claimed_tasks import claimed_tasks, static_tasks
from .loop_nests import blocked_reduction, packed_rows, whole_reduction
from .prefetch import CACHE_LINE_BYTES
from .tile import PackedOperator, Tile, remainder_heights

# The first row tile of a task reads the task's weight block from DRAM (in the served model no
# cache holds the weights) while it computes a fraction of the task's FMAs; the later row tiles
# compute from the cache while the memory bus idles. So the later tiles prefetch the task's next
# block, spread over them (``NextBlock``). bert-base, the same plans built with and without,
# interleaved (``compare_artifacts.py``, znver4): seq 31 1.07-1.08x, 48 1.04-1.05x, 64
# 1.01-1.02x, other lengths within the machine's noise; hot, the kernels time as before.
PREFETCH_NEXT_BLOCK = True
# Where the later passes are more than the next block needs at a line a step, its lines are
# spread over them (up to 8 times as many passes, ``NextBlock``), not fetched in the first few
# at a pace one core's share of the DRAM cannot keep. Weight from DRAM, with / without,
# interleaved, 7 rounds (``cold_weights.py --interleaved --without spread``, 2-core Emerald
# Rapids): 3072 -> 768 7 x 48 tile T = 48 / 64 / 128 1.12 / 1.10 / 1.00x, 6 x 64 1.01-1.05x;
# 768 -> 3072 9 x 48 T = 64 / 128 1.09 / 1.10x, 4 x 96 1.01-1.08x, 7 x 48 in 256-deep blocks
# 1.04-1.19x (T = 256: 0.98-1.05x). bert-base, one version-45 tune's plans built with and
# without (``compare_artifacts.py``, 11 rounds): seq 48-256 1.008-1.054x, the control
# 0.986-1.020x.
SPREAD_NEXT_BLOCK = True
# On Intel's server cores a pass reading the weight from DRAM did not overlap the stream with its
# FMAs: it took about the stream plus its time with the weight in cache (3072 -> 768, 9-row
# tile, 2-core Emerald Rapids VM, ``cold_weights.py``: T = 1 0.35 ms, T = 7 0.59 against 0.20
# hot, T = 16 0.88 against 0.35). The hardware's prefetchers run a few lines ahead and stop at
# every 4 KB page, and the more FMAs a step has, the fewer lines the core has in flight. So the
# passes that fetch no next block also fetch, each step, the lines STREAM_AHEAD_BYTES on in
# their panel's run: there, at 4096 bytes, T = 7 ran 1.35-1.40x, T = 16 1.16-1.37x, T = 31
# 1.18x, T = 64 1.10x, T = 1-3 1.00-1.13x (interleaved, 5 rounds; 1024 ahead: about half the
# gain, 16384: less). AMD's Zen 4 overlapped the stream without them (``weight_stream.py``),
# so only the CPUs of ``STREAM_AHEAD_CPUS`` get them.
STREAM_AHEAD = True
STREAM_AHEAD_BYTES = 4096
STREAM_AHEAD_CPUS = ("skylake-avx512", "cascadelake", "cooperlake", "icelake-server", "sapphirerapids",
                     "emeraldrapids", "graniterapids")
# The tasks are taken at run time by the target's cores (``claimed_tasks``), not split evenly in
# advance: on a shared machine a call then waits less for a core slowed by a neighbour.
CLAIMED_TASKS = True
# A register tile broadcasts one element of each of its rows per reduction step. Where the rows'
# stride is a multiple of 4 KB (K = 1024, 3072 floats) they all fall in one L1 set (x86 L1 data
# caches index within a 4 KB page: 64 sets of 64-byte lines), and a tile taller than the set's
# ways evicts its own rows every step. Such tiles read a k-major copy of their rows instead
# (``packed_rows``): one line holds a step's broadcasts. bert-base's 3072 -> 768 layer, forced
# 13-row tile, weight in cache / from DRAM (``cold_weights.py --without row-copy``, znver4):
# 1.14x / 1.52x at T = 13, 1.12-1.27x / 1.08-1.39x at T = 16-512. Tiles of 4-8 rows there ran
# 0.85-1.01x hot with the copy, and 768-deep layers' (4 sets) 0.91-0.96x: it is made only where rows crowd a set
# (``crowding_rows``), and only for row counts that fill that many of the tile's rows.
PACK_ROWS = True
# A remainder tile of too few rows to crowd a set reads them in place, not from the copy: the
# copy holds a step's rows side by side for the whole tile, so a 1-row remainder pass read a new
# line of it every step, beside its two lines of weight. Forced 3072 -> 768 tiles, weight in
# cache, 7 rounds interleaved, in place / from the copy: 13 rows at T = 14 (13 + 1) 1.073x, 15
# 1.065x, 16-17 1.024-1.026x, 27 1.042x, 18-31 otherwise 1.000-1.017x; 12 rows at T = 13-14
# 1.066-1.069x; whole tiles (T = 13 on 13 rows) 1.000x.
REMAINDER_ROWS_IN_PLACE = True
L1_SET_SPAN_BYTES = 4096
L1_WAYS = 8  # the fewest of the x86 cores in view (AMD Zen: 32 KB, 8 ways; Intel: 48 KB, 12)
# The last row pass of a tile that does not divide T runs a tile of the rows left instead of
# computing padded rows (``Tile.passes``): T = 11 on a 9-row tile computes 11 rows, not 18.
REMAINDER_TILES = True
# An epilogue larger than this (TIR nodes; BERT's GELU has 266, bias and residual 11-15) runs in
# one loop over the tile's rows after the sums are stored to the stack, not written out on every
# row's registers: LLVM spent 1.7 of the 2.3 s building an 8-row tile of the GELU layer on its
# 8 x 3 inline GELUs, and the tuner builds one kernel per trial.
EPILOGUE_LOOP = True
EPILOGUE_UNROLLED_NODES = 64


def packed_tile(kernel: MicroKernel) -> tuple[int, int, int, int]:
    """(mr, panel, panels per register tile, panels per task) of a packed micro-kernel."""
    (mr,) = kernel.tile_sizes("i")
    panel, pk, groups = kernel.tile_sizes("j")
    return mr, panel, pk, pk * groups


def stream_ahead_bytes(mcpu: str | None) -> int:
    """How far ahead a pass over the weight fetches it on the CPU LLVM calls ``mcpu`` (0: not;
    ``STREAM_AHEAD``)."""
    return STREAM_AHEAD_BYTES if STREAM_AHEAD and mcpu in STREAM_AHEAD_CPUS else 0


def apply_cpu_packed(func: tirx.PrimFunc, kernel: MicroKernel, workers: int | None = None,
                     mcpu: str | None = None) -> tirx.PrimFunc:
    """``func`` (already reading its weight packed, ``pack_prim_func``) as ``kernel``'s loop nest;
    ``workers``: the threads that take its tasks at run time (``claimed_tasks``: the target's
    cores), None: TVM's even split of them; ``mcpu``: the CPU it is built for
    (``stream_ahead_bytes``)."""
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
    epilogue_loop = EPILOGUE_LOOP and expression_size(op.epilogue) > EPILOGUE_UNROLLED_NODES
    tile = Tile(op, mr, panel, pk, lanes, rows, REMAINDER_TILES, epilogue_loop)
    loop = T.parallel if kernel.threads != 1 else T.serial
    if kernel.threads != 1 and workers and CLAIMED_TASKS:
        tasks = partial(claimed_tasks, workers=workers)
    else:
        tasks = partial(static_tasks, loop)
    crowding = crowding_rows(mr, int(depth) * op.activation.source.dtype.bits // 8) \
        if PACK_ROWS and op.activation is not None and isinstance(depth, tirx.IntImm) else None

    distance = stream_ahead_bytes(mcpu)

    def reduction(tile: Tile) -> None:
        if blocked:
            blocked_reduction(tile, tasks, int(panels) // nb, nb, depth, kc, PREFETCH_NEXT_BLOCK, distance,
                              SPREAD_NEXT_BLOCK)
        else:
            whole_reduction(tile, tasks, int(panels) // nb, nb, depth, PREFETCH_NEXT_BLOCK, distance, SPREAD_NEXT_BLOCK)

    with IRBuilder() as builder, T.seq_scope():
        if crowding is None:
            reduction(tile)
        else:
            # With fewer rows the tile's padded rows read the last real one again: they crowd
            # no set, and the copy would only cost (T = 7 on a 9-row tile: 2-7% slower with it).
            # Those fewer rows are one remainder pass: the whole tile is emitted once, not twice
            # (the 3072-deep layers' kernels built in 1.2 s, 3x the 768-deep ones').
            with T.If(rows >= crowding):
                with T.Then():
                    reduction(tile.with_rows_copied(packed_rows(tile, loop, int(depth)),
                                                    crowding if REMAINDER_ROWS_IN_PLACE else None))
                with T.Else():
                    reduction(tile.with_fewer_rows_than(crowding))
    body = builder.get().body  # (inside seq_scope's frame, which only let two loops follow each other)
    if PREFETCH_NEXT_BLOCK or distance:
        body = tirx.SeqStmt([tirx.DeclBuffer(op.flat_weight, data=op.weight.data), body])
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


__all__ = ["apply_cpu_packed", "computed_extent", "crowding_rows", "packed_tile", "reduces_in_blocks",
           "remainder_heights", "with_whole_reduction"]
