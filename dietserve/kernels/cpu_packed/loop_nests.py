"""The packed GEMM kernel's loop nests (``kernel.py``): the tasks and row passes of the
whole and the blocked reduction, the k-major copy of crowding rows, and a bf16 kernel's rows
converted to pairs."""

from __future__ import annotations

import math
from contextlib import contextmanager

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from ..tir.computed_once import computed_once
from . import bf16
from .prefetch import NextBlock, stream_ahead
from .tile import Tile

PACK_CHUNK = 256  # reduction steps per job of the copy


def packed_rows(tile: Tile, loop, depth: int):
    """X's rows copied per row tile, k-major: row ``r`` of the tile at ``i0``, step ``k``, at
    ``i0 * depth + k * mr + r`` (padded rows repeat the last real one)."""
    row_tiles = tile.row_tiles()
    chunk = math.gcd(depth, PACK_CHUNK)
    chunks = depth // chunk
    packed = T.alloc_buffer((row_tiles * tile.mr * depth,), tile.op.activation_dtype)
    with loop(0, row_tiles * chunks) as job:
        i0, k0 = job // chunks * tile.mr, job % chunks * chunk
        for r in range(tile.mr):
            with T.serial(0, chunk) as kk:
                T.buffer_store(packed, tile.op.activation_at(tile.clamped_row(i0, r), k0 + kk),
                               [i0 * depth + (k0 + kk) * tile.mr + r])
    return packed


def paired_rows(tile: Tile, loop, depth: int):
    """bf16: X's rows as pairs of steps, row ``i``'s pair step ``k`` at ``i * depth + k``
    (``depth``: pair steps). Each job converts a chunk of a row 16 pairs at a time, from two
    vector loads to one contiguous vector store (the k-major copy scatters its stores, one
    word a row apart)."""
    lanes = bf16.PAIR_LANES
    chunk = math.gcd(depth, PACK_CHUNK)
    chunks = depth // chunk
    pairs = T.alloc_buffer((tile.rows * depth,), "uint32")
    with loop(0, tile.rows * chunks) as job:
        row, k0 = job // chunks, job % chunks * chunk
        with T.serial(0, chunk // lanes) as v:
            first = k0 + v * lanes
            T.buffer_store(pairs, tile.op.activation_pairs(row, first),
                           [tirx.Ramp(row * depth + first, tirx.const(1, first.ty.dtype), lanes)])
    return pairs


def _reduce(tile: Tile, accs, i0, panel0, k_first, extent, ahead: NextBlock | None = None, unit=0,
            distance: int = 0) -> None:
    """``accs`` += the tile's products over reduction steps ``k_first`` .. ``+ extent - 1``;
    with ``ahead``, step ``kk`` also fetches a line of the next block (``NextBlock.prefetch``),
    else, with a ``distance``, the lines that far ahead of its own (``stream_ahead``)."""
    with T.serial(0, extent) as kk:
        tile.multiply_add(accs, i0, panel0, k_first + kk)
        if ahead is not None:
            ahead.prefetch(unit, kk)
        elif distance:
            stream_ahead(tile, panel0, k_first + kk, distance)


def _reduce_fetching(tile: Tile, accs, i0, panel0, k_first, extent, ahead: NextBlock | None, when, unit,
                     distance: int) -> None:
    """The reduction, also fetching ``ahead`` (None: no prefetches) where ``when`` holds (a
    row pass after the task's first, with a next block) and its units are enough for the block;
    elsewhere the lines ``distance`` bytes ahead of each step's (0: none)."""
    if ahead is None or tile.remainder:
        # (a remainder pass leaves its share of the next block to the hardware: its own copy of
        # the loop with those prefetches would add as much code again to every kernel)
        _reduce(tile, accs, i0, panel0, k_first, extent, distance=distance)
        return
    with T.If(tirx.all(when, ahead.enough())):
        with T.Then():
            _reduce(tile, accs, i0, panel0, k_first, extent, ahead, unit)
        with T.Else():
            _reduce(tile, accs, i0, panel0, k_first, extent, distance=distance)


def whole_reduction(tile: Tile, tasks, blocks: int, nb: int, depth, prefetch: bool, distance: int = 0,
                    spread: bool = False) -> None:
    """Each task: one row tile over ``nb`` panels, the whole reduction in registers. ``tasks``:
    the task loop (``claimed_tasks``, ``static_tasks``); ``prefetch``: the later passes fetch the
    next block (``NextBlock``), spread over up to 8 times as many of them where they are that many
    (``spread``); ``distance``: the other passes fetch that many bytes ahead (``stream_ahead``;
    0: not)."""
    row_tiles = tile.row_tiles()
    groups = nb // tile.pk
    with tasks(blocks * row_tiles) as claim:
        block, it = computed_once(claim.task // row_tiles, claim.task % row_tiles)
        # A worker going backward passes over a block's row tiles from the last: its passes
        # after the block's first count from there, and its next block is the one before.
        later_pass = tirx.Select(claim.forward, it - 1, row_tiles - 2 - it)
        next_block = tirx.Select(claim.forward, block + 1, block - 1)
        i0 = it * tile.mr
        # the whole tile's sums the epilogue loop reads (``epilogue_loop``; scope "global": a
        # stack array)
        tile_sums = T.alloc_buffer((tile.mr, tile.pk * tile.panel), tile.dtype, scope="global") \
            if tile.epilogue_loop else None

        def reduce(tile: Tile, accs: list, group) -> None:
            tile.zero(accs)
            ahead = NextBlock(tile, row_tiles, next_block * nb, nb, 0, int(depth), int(depth), spread) \
                if prefetch else None
            _reduce_fetching(tile, accs, i0, block * nb + group * tile.pk, 0, depth, ahead,
                             tirx.all(later_pass >= 0, next_block >= 0, next_block < blocks),
                             later_pass * groups + group, distance)

        def row_pass(tile: Tile, remainder_sums=None) -> None:
            with T.serial(0, nb // tile.pk) as group:
                accs = tile.accumulators()
                reduce(tile, accs, group)
                if tile.remainder:
                    tile.save(accs, remainder_sums, 0, group * tile.pk * tile.panel)
                else:
                    tile.finish(accs, i0, block * nb + group * tile.pk, tile_sums, 0, 0)

        @contextmanager
        def remainder(left):
            # every panel's sums of the rows left, for the one epilogue loop after them
            sums = T.alloc_buffer((tile.mr, nb * tile.panel), tile.dtype, scope="global")
            yield lambda tile: row_pass(tile, sums)
            tile.finish_rows(sums, 0, 0, i0, block * nb, left, panels=nb)

        tile.passes(i0, groups, row_pass, remainder)


def blocked_reduction(tile: Tile, tasks, blocks: int, nb: int, depth, kc: int, prefetch: bool,
                      distance: int = 0, spread: bool = False) -> None:
    """Each task: ``nb`` panels over every row tile, the reduction in ``kc``-deep blocks (the
    block stays in L2 while the row tiles pass over it), partial sums in the task's workspace.
    ``tasks``: the task loop (``claimed_tasks``, ``static_tasks``); ``prefetch``, ``distance``,
    ``spread``: as ``whole_reduction``'s."""
    row_tiles = tile.row_tiles()
    last = int(depth) // kc - 1
    groups = nb // tile.pk
    with tasks(blocks) as claim:
        task = claim.task
        partial = T.alloc_buffer((row_tiles * tile.mr, nb * tile.panel), tile.dtype)
        with T.serial(0, last + 1) as ko:
            with T.serial(0, row_tiles) as it:
                i0 = it * tile.mr

                def reduce(tile: Tile, accs: list, group) -> None:
                    column0 = group * tile.pk * tile.panel
                    with T.If(ko == 0):
                        with T.Then():
                            tile.zero(accs)
                        with T.Else():
                            tile.load(accs, partial, i0, column0)
                    # Next: this task's next reduction block, or after its last the next task's first.
                    ahead = NextBlock(tile, row_tiles, tirx.Select(ko < last, task, claim.successor()) * nb,
                                      nb, tirx.Select(ko < last, ko * kc + kc, 0), kc, int(depth), spread) \
                        if prefetch else None
                    _reduce_fetching(tile, accs, i0, task * nb + group * tile.pk, ko * kc, kc, ahead,
                                     tirx.all(it >= 1, tirx.any(ko < last, claim.has_successor(blocks))),
                                     (it - 1) * groups + group, distance)

                def row_pass(tile: Tile) -> None:
                    with T.serial(0, nb // tile.pk) as group:
                        accs = tile.accumulators()
                        reduce(tile, accs, group)
                        column0 = group * tile.pk * tile.panel
                        if tile.remainder:
                            tile.save(accs, partial, i0, column0)  # (the partial sums hold whole tiles)
                        else:
                            with T.If(ko == last):
                                with T.Then():
                                    tile.finish(accs, i0, task * nb + group * tile.pk, partial, i0, column0)
                                with T.Else():
                                    tile.save(accs, partial, i0, column0)

                @contextmanager
                def remainder(left):
                    yield row_pass
                    with T.If(ko == last):
                        with T.Then():
                            tile.finish_rows(partial, i0, 0, i0, task * nb, left, panels=nb)

                tile.passes(i0, groups, row_pass, remainder)
