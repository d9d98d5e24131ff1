"""Attention over packed sequences on a CPU: each sequence attends to itself alone, over its own
length, with no mask and no padded work.

The encoder runs on all the sequences' tokens as one ``[T, ...]`` block (T the sum of their
lengths); ``starts`` (``cu_seqlens``: ``B + 1`` offsets, the last one T) says where each begins.
The input is the fused QKV projection, ``[T, 3 * heads * head_dim]``, queries', keys' and values'
heads side by side; the output the context, ``[T, heads * head_dim]``, heads side by side, as the
output projection reads it.

    tasks over (head, sequence), head-major: an even split hands every core whole heads of
    every sequence, so one long sequence among short ones does not land on one core
        K^T copied once per task, in [head_dim, nr] panels, zero up to whole panels
        (lanes x lanes blocks transposed in registers where the head is whole vectors)
        for each tile of mr queries (the last starts mr before the end: clamped, no padding)
            Q tile [mr, head_dim], scaled by 1 / sqrt(head_dim)
            scores [mr, L] in mr x nr register tiles: Q broadcast, K^T vectors
            each row's max kept as the scores are stored; then exp(score - max) and its sum
            in one pass (``avx512_softmax_exp`` on 16-lane tiles, else ``softmax_exp``)
            context [mr, head_dim] in mr x nc register tiles: exp broadcast, V rows vectors,
            divided by the sum as it is stored for the tile's rows

The scores kernel is the dense micro-kernel's shape (broadcast x vector FMAs into ``mr x nr``
accumulators); the context reads V copied once per task, a row of head_dim floats each.
Sequences shorter than ``mr`` run the same code on a zero-filled Q tile and store only their
rows. The tile sizes are the kernel's parameters (``tile.py``): one tile chosen from the register
file, or tuned tiles behind a tree over each sequence's length, compiled in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from ..cpu_packed.bf16 import PAIR_LANES, PRECISION_ATTR, adjacent_pairs, dot_pairs, importing_bf16_functions, pair
from ..plan.decision_tree import TreeError, check_tree
from ..tir.build import with_exact_buffers
from ..tir.computed_once import computed_once
from ..tir.fast_exp import AVX512_LANES, avx512_softmax_exp, softmax_exp
from ..tir.row_softmax import LOWEST
from .tile import LENGTH_VAR, VarlenTile, context_tile

VARLEN_ATTENTION = "dietserve.varlen_attention"  # the PrimFunc attribute naming its (heads, head_dim)


Tiles = VarlenTile | Mapping[str, VarlenTile]


def varlen_attention(heads: int, head_dim: int, max_len: int, tiles: Tiles | None = None, tree: Mapping | None = None,
                     parallel: bool = True, precision: str = "fp32") -> tirx.PrimFunc:
    """The PrimFunc ``(qkv [T, 3 * heads * head_dim], starts [B + 1] int64, out [T, heads *
    head_dim])``; ``max_len`` bounds a sequence's length (the position table's size).

    ``tiles`` is one tile (default ``VarlenTile()``), or named tiles with ``tree``, a decision tree over ``length``
    (``plan/decision_tree.py``) compiled into the kernel: each (head, sequence) task runs the
    tile its sequence's length picks, its stack arrays sized for the lengths that reach it.
    ``bf16``: both products multiply bf16 pairs (``bf16_attention_fits``; the softmax and the
    sums stay fp32), on a target with AVX512-BF16."""
    if tiles is None or isinstance(tiles, VarlenTile):
        tiles, tree = {"tile": tiles or VarlenTile()}, {"variant": "tile"}
    try:
        check_tree(tree, tiles, [LENGTH_VAR])
    except TreeError as err:
        raise ValueError(f"attention tiles {sorted(tiles)}: {err}") from err
    pairs = precision == "bf16"
    if pairs and not all(bf16_attention_fits(tile, head_dim) for tile in tiles.values()):
        raise ValueError(f"bf16 attention needs {PAIR_LANES}-lane tiles and context tiles over an even head_dim; "
                         f"tiles {sorted(t.describe() for t in tiles.values())} for head_dim {head_dim} are not")
    width = heads * head_dim
    tokens, segments = tirx.Var("tokens", "int64"), tirx.Var("segments", "int64")
    with IRBuilder() as builder:
        with T.prim_func():
            qkv = T.arg("qkv", T.Buffer((tokens, 3 * width), "float32"))
            starts = T.arg("starts", T.Buffer((segments,), "int64"))
            out = T.arg("out", T.Buffer((tokens, width), "float32"))
            # scheduled as written: the default rules leave it alone
            T.func_attr({VARLEN_ATTENTION: [heads, head_dim], "tirx.is_scheduled": True})
            sequences = segments - 1
            loop = T.parallel if parallel else T.serial
            with loop(0, heads * sequences) as task:
                h, b = computed_once(tirx.floordiv(task, sequences), tirx.floormod(task, sequences))
                start, length = computed_once(starts[b], starts[b + 1] - starts[b])
                _dispatch(tree, (qkv, out, (h, start, length), heads, head_dim), tiles, max_len, pairs)
    func = builder.get()
    if pairs:
        func = func.with_body(importing_bf16_functions(func.body)).with_attr(PRECISION_ATTR, precision)
    return with_exact_buffers(func, own_storage=True)


def bf16_attention_fits(tile: VarlenTile, head_dim: int) -> bool:
    """Whether ``tile``'s products can run on bf16 pairs for ``head_dim``: 16-lane vectors in both
    (one ``vdpbf16ps`` a vector) and pairs of head_dim columns for the scores."""
    return tile.lanes == PAIR_LANES and context_tile(head_dim, tile)[1] == PAIR_LANES and head_dim % 2 == 0


def _dispatch(node: Mapping, call: tuple, tiles: Mapping[str, VarlenTile], longest: int, pairs: bool) -> None:
    """The tree as nested ifs on the sequence's length; ``longest``: the most a leaf can see."""
    if "variant" in node:
        tile = tiles[node["variant"]]
        _sequence(*call, -(-longest // tile.nr) * tile.nr, tile, pairs)
        return
    if node["var"] != LENGTH_VAR:
        raise ValueError(f"an attention tree branches on {LENGTH_VAR!r} alone, not {node['var']!r}")
    length = call[2][2]
    with T.If(length <= node["le"]):
        with T.Then():
            _dispatch(node["then"], call, tiles, min(longest, max(int(node["le"]), 1)), pairs)
        with T.Else():
            _dispatch(node["else"], call, tiles, longest, pairs)


def _sequence(qkv, out, where, heads, head_dim, key_columns, tile: VarlenTile, pairs: bool = False) -> None:
    """One head of one sequence; ``pairs``: its products on bf16 pairs (``_PairedProducts``)."""
    h, start, length = where
    mr, nr, lanes = tile.mr, tile.nr, tile.lanes
    nc, context_lanes = context_tile(head_dim, tile)
    zero, lowest = tirx.const(0, "float32"), tirx.const(LOWEST, "float32")
    scale = tirx.const(1 / math.sqrt(head_dim), "float32")
    q_column, k_column, v_column = h * head_dim, (heads + h) * head_dim, (2 * heads + h) * head_dim
    key_tiles = (length + nr - 1) // nr
    # (scope "global": stack arrays, allocated once per task; "local" ones this size would go
    # through the runtime's workspace calls wherever they are declared)
    # (bf16: whole 32-column blocks, which ``_PairedProducts.exponentiate`` converts at once)
    score_columns = -(-key_columns // (2 * PAIR_LANES)) * 2 * PAIR_LANES if pairs else key_columns
    scores = T.alloc_buffer((mr, score_columns), "float32", scope="global")
    queries = T.alloc_buffer((mr, head_dim), "float32", scope="global")
    row_max = T.alloc_buffer((mr, lanes), "float32", scope="global")
    row_sum = T.alloc_buffer((mr, lanes), "float32", scope="global")
    keys = values = None
    if not pairs or not _PairedProducts.transposes(head_dim):
        keys, values = _copied_keys_and_values(qkv, (start, length), (k_column, v_column), key_columns, head_dim, nr,
                                               lanes)
    paired = None
    if pairs:
        paired = _PairedProducts(tile, head_dim, length, key_columns, score_columns)
        paired.copy_keys(qkv, start, k_column, keys)
        paired.copy_values(qkv, start, v_column)
    with T.serial(0, (length + mr - 1) // mr) as t:
        i0 = tirx.max(tirx.min(t * mr, length - mr), 0)
        rows = tirx.min(length, mr)
        with T.unroll(0, mr) as ii:
            with T.vectorized(0, head_dim) as d:
                T.buffer_store(queries, tirx.Select(ii < rows, qkv[start + i0 + tirx.min(ii, rows - 1), q_column + d]
                                                    * scale, zero), [ii, d])
            with T.vectorized(0, lanes) as lane:
                T.buffer_store(row_max, lowest, [ii, lane])
                T.buffer_store(row_sum, zero, [ii, lane])
        # scores, and each row's running max over its real columns (lane by lane)
        if paired is not None:
            paired.pair_queries(queries)
        with T.serial(0, key_tiles) as jo:
            acc = T.alloc_buffer((mr, nr), "float32", scope="global")
            _tile_loop(mr, nr, lanes, lambda ii, jv, lane: T.buffer_store(acc, zero, [ii, jv * lanes + lane]))
            if paired is not None:
                paired.scores(acc, jo)
            else:
                with T.serial(0, head_dim) as d:
                    _tile_loop(mr, nr, lanes, lambda ii, jv, lane: T.buffer_store(
                        acc, acc[ii, jv * lanes + lane] + queries[ii, d] * keys[jo, d, jv * lanes + lane],
                        [ii, jv * lanes + lane]))

            def store(ii, jv, lane, masked: bool):
                column = jo * nr + jv * lanes + lane
                score = acc[ii, jv * lanes + lane]
                T.buffer_store(scores, score, [ii, column])
                T.buffer_store(row_max, tirx.max(row_max[ii, lane], tirx.Select(column < length, score, lowest)
                                                 if masked else score), [ii, lane])

            # (only the last key tile holds columns past the sequence's end)
            with T.If(jo * nr + nr <= length):
                with T.Then():
                    _tile_loop(mr, nr, lanes, lambda ii, jv, lane: store(ii, jv, lane, False))
                with T.Else():
                    _tile_loop(mr, nr, lanes, lambda ii, jv, lane: store(ii, jv, lane, True))
        # exp(score - max), summed; bf16: straight into pairs
        if paired is not None:
            paired.exponentiate(scores, row_max, row_sum)
        else:
            _exponentials(scores, row_max, row_sum, mr, lanes, length)
        # context = (e @ V) / sum, the division folded into the store
        with T.unroll(0, head_dim // nc) as co:
            context = T.alloc_buffer((mr, nc), "float32", scope="global")
            _tile_loop(mr, nc, context_lanes, lambda ii, cv, lane: T.buffer_store(
                context, zero, [ii, cv * context_lanes + lane]))
            if paired is not None:
                paired.context(context, co * nc, nc)
            else:
                with T.serial(0, length) as j:
                    _tile_loop(mr, nc, context_lanes, lambda ii, cv, lane: T.buffer_store(
                        context, context[ii, cv * context_lanes + lane]
                        + scores[ii, j] * values[j, co * nc + cv * context_lanes + lane],
                        [ii, cv * context_lanes + lane]))
            with T.unroll(0, mr) as ii:
                with T.If(ii < rows):
                    with T.Then():
                        inverse = tirx.const(1, "float32") / _lane_reduce(row_sum, ii, lanes, tirx.Add)
                        with T.vectorized(0, nc) as cc:
                            T.buffer_store(out, context[ii, cc] * inverse, [start + i0 + ii, q_column + co * nc + cc])


class _PairedProducts:
    """The two products of one (head, sequence) task on bf16 pairs (``kernels/cpu_packed/bf16.py``):
    the scores over pairs of head_dim columns, the context over pairs of keys. K^T's panels and
    V's rows are converted once per task, a tile's queries and exponentials once per tile; the
    running max, exp and sums stay fp32. A pair past the sequence's end holds zeros."""

    def __init__(self, tile: VarlenTile, head_dim: int, length, key_columns: int, score_columns: int):
        self.tile, self.length, self.half = tile, length, head_dim // 2
        mr, nr = tile.mr, tile.nr
        self.keys = T.alloc_buffer((key_columns // nr, self.half, nr), "uint32", scope="global")
        self.values = T.alloc_buffer(((key_columns + 1) // 2, head_dim), "uint32", scope="global")
        self.queries = T.alloc_buffer((mr, self.half), "uint32", scope="global")
        self.exponentials = T.alloc_buffer((mr, score_columns // 2), "uint32", scope="global")

    @staticmethod
    def transposes(head_dim: int) -> bool:
        """Whether K's pairs are transposed from the QKV block in 16 x 16 blocks of pair words
        (``copy_keys``): where a head's pairs are whole vectors."""
        return head_dim % (2 * PAIR_LANES) == 0

    def copy_keys(self, qkv, start, k_column, keys) -> None:
        """K^T's panels as pairs of head_dim columns, zero past the sequence's end up to whole
        panels. From ``keys`` (fp32 panels) where given; else straight from the QKV block: each
        key's row converted to pairs (one ``vcvtne2ps2bf16`` per 16 words), 16 keys' rows
        transposed in registers (``_transposed``) and stored whole, in place of an element-wise
        transpose of the fp32 values."""
        lanes, nr = PAIR_LANES, self.tile.nr
        if keys is not None:
            with T.serial(0, (self.length + nr - 1) // nr) as jo:
                with T.serial(0, self.half) as d:
                    with T.vectorized(0, nr) as j:
                        T.buffer_store(self.keys, pair(keys[jo, 2 * d, j], keys[jo, 2 * d + 1, j]), [jo, d, j])
            return
        no_words = tirx.Broadcast(tirx.const(0, "uint32"), lanes)
        with T.serial(0, (self.length + nr - 1) // nr * (nr // lanes)) as group:
            for block in range(self.half // lanes):
                rows = []
                for i in range(lanes):
                    key = group * lanes + i
                    row = start + tirx.min(key, self.length - 1)
                    first = k_column + 2 * lanes * block
                    words = adjacent_pairs(*(qkv[row, tirx.Ramp(first + lanes * part, 1, lanes)] for part in (0, 1)))
                    rows.append(T.bind(tirx.Select(tirx.Broadcast(key < self.length, lanes), words, no_words)))
                for word, column in enumerate(_transposed(rows)):
                    T.buffer_store(self.keys, column, [group * lanes // nr, block * lanes + word,
                                                       tirx.Ramp(group * lanes % nr, 1, lanes)])

    def copy_values(self, qkv, start, v_column) -> None:
        """V's rows as pairs of keys, from the QKV block (the odd key past the end as zero)."""
        zero = tirx.const(0, "float32")
        with T.serial(0, (self.length + 1) // 2) as j:
            odd = 2 * j + 1
            with T.vectorized(0, 2 * self.half) as d:
                T.buffer_store(self.values, pair(qkv[start + 2 * j, v_column + d], tirx.Select(
                    odd < self.length, qkv[start + tirx.min(odd, self.length - 1), v_column + d], zero)), [j, d])

    def pair_queries(self, queries) -> None:
        with T.unroll(0, self.tile.mr) as ii:
            with T.vectorized(0, self.half) as d:
                T.buffer_store(self.queries, pair(queries[ii, 2 * d], queries[ii, 2 * d + 1]), [ii, d])

    def scores(self, acc, jo) -> None:
        """``acc`` (``mr x nr``) += the tile's queries times key panel ``jo``."""
        lanes = PAIR_LANES
        with T.serial(0, self.half) as d:
            for ii in range(self.tile.mr):
                for jv in range(self.tile.nr // lanes):
                    columns = tirx.Ramp(tirx.const(jv * lanes, "int32"), tirx.const(1, "int32"), lanes)
                    T.buffer_store(acc, dot_pairs(acc[ii, columns], self.queries[ii, d],
                                                  self.keys[jo, d, columns]), [ii, columns])

    def exponentiate(self, scores, row_max, row_sum) -> None:
        """The tile's exponentials, exp(score - row max), summed in fp32 into ``row_sum`` and
        stored as pairs of keys: 32 keys (two vectors) a step, each converted by one
        ``vcvtne2ps2bf16``; the columns past the sequence's end as zeros. Their exp is
        ``avx512_softmax_exp``: they are rounded to bf16 next."""
        lanes = PAIR_LANES
        zeros = tirx.Broadcast(tirx.const(0, "float32"), lanes)
        whole = self.length // (2 * lanes)

        def step(ii, peak, u, masked: bool) -> None:
            halves = []
            for first in (u * 2 * lanes, u * 2 * lanes + lanes):
                columns = tirx.Ramp(tirx.Cast("int64", first), tirx.const(1, "int64"), lanes)
                e = avx512_softmax_exp(scores[ii, columns] - peak)
                if masked:
                    e = tirx.Select(columns < tirx.Broadcast(tirx.Cast("int64", self.length), lanes), e, zeros)
                halves.append(T.bind(e))
            sums = tirx.Ramp(tirx.const(0, "int32"), tirx.const(1, "int32"), lanes)
            T.buffer_store(row_sum, row_sum[ii, sums] + halves[0] + halves[1], [ii, sums])
            words = tirx.Ramp(tirx.Cast("int64", u * lanes), tirx.const(1, "int64"), lanes)
            T.buffer_store(self.exponentials, adjacent_pairs(*halves), [ii, words])

        with T.unroll(0, self.tile.mr) as ii:
            peak = T.bind(tirx.Broadcast(_lane_reduce(row_max, ii, lanes, tirx.max), lanes))
            with T.serial(0, whole) as u:
                step(ii, peak, u, masked=False)
            with T.If(self.length % (2 * lanes) > 0):
                with T.Then():
                    step(ii, peak, whole, masked=True)

    def context(self, context, column0, nc: int) -> None:
        """``context`` (``mr x nc``) += the tile's exponentials times V's columns from ``column0``."""
        lanes = PAIR_LANES
        with T.serial(0, (self.length + 1) // 2) as j:
            for ii in range(self.tile.mr):
                for cv in range(nc // lanes):
                    columns = tirx.Ramp(tirx.const(cv * lanes, "int32"), tirx.const(1, "int32"), lanes)
                    in_v = tirx.Ramp(column0 + cv * lanes, tirx.const(1, "int32"), lanes)
                    T.buffer_store(context, dot_pairs(context[ii, columns], self.exponentials[ii, j],
                                                      self.values[j, in_v]), [ii, columns])


def _copied_keys_and_values(qkv, where, columns, key_columns, head_dim: int, nr: int, lanes: int):
    """(K^T in ``nr``-column panels, zero up to whole panels; V's rows), copied from the QKV
    block. The panels are contiguous: a ``[head_dim, L]`` array's rows would alias in L1 when L is
    a power of two, as the reduction walks down them. V's rows are copied contiguous too: in the
    QKV block they lie ``3 * heads * head_dim`` floats apart, a page or more each. K is
    transposed ``lanes`` keys by ``lanes`` columns at a time in registers (``_transposed``) where
    the head's columns are whole vectors, element by element where not."""
    (start, length), (k_column, v_column) = where, columns
    keys = T.alloc_buffer((key_columns // nr, head_dim, nr), "float32", scope="global")
    values = T.alloc_buffer((key_columns, head_dim), "float32", scope="global")
    with T.serial(0, length) as j:
        with T.vectorized(0, head_dim) as d:
            T.buffer_store(values, qkv[start + j, v_column + d], [j, d])
    panels = (length + nr - 1) // nr
    if head_dim % lanes == 0:
        zeros = tirx.Broadcast(tirx.const(0, "float32"), lanes)
        with T.serial(0, panels * (nr // lanes)) as group:
            for block in range(head_dim // lanes):
                rows = []
                for i in range(lanes):
                    key = group * lanes + i
                    row = qkv[start + tirx.min(key, length - 1), tirx.Ramp(k_column + block * lanes, 1, lanes)]
                    rows.append(T.bind(tirx.Select(tirx.Broadcast(key < length, lanes), row, zeros)))
                for d, column in enumerate(_transposed(rows)):
                    T.buffer_store(keys, column, [group * lanes // nr, block * lanes + d,
                                                  tirx.Ramp(group * lanes % nr, 1, lanes)])
        return keys, values
    with T.serial(0, length) as j:
        with T.serial(0, head_dim) as d:
            T.buffer_store(keys, qkv[start + j, k_column + d], [j // nr, d, j % nr])
    with T.serial(0, panels * nr - length) as j:  # zeros up to whole panels: their scores are not read
        with T.serial(0, head_dim) as d:
            T.buffer_store(keys, tirx.const(0, "float32"), [(length + j) // nr, d, (length + j) % nr])
    return keys, values


def _exponentials(scores, row_max, row_sum, mr: int, lanes: int, length) -> None:
    """exp(score - row max) in place, summed lane by lane into ``row_sum``: whole vectors, then
    the last part vector (0 past the real columns, within the panels). On 16-lane (AVX-512)
    tiles by ``avx512_softmax_exp``, otherwise by the fused softmax's ``softmax_exp``."""
    zero = tirx.const(0, "float32")
    with T.unroll(0, mr) as ii:
        peak = _lane_reduce(row_max, ii, lanes, tirx.max)

        def exponentials(v, masked: bool) -> None:
            if lanes == AVX512_LANES:
                columns = tirx.Ramp(v * lanes, 1, lanes)
                e = avx512_softmax_exp(scores[ii, columns] - tirx.Broadcast(peak, lanes))
                if masked:
                    e = tirx.Select(columns < tirx.Broadcast(length, lanes), e, tirx.Broadcast(zero, lanes))
                e = T.bind(e)
                T.buffer_store(scores, e, [ii, columns])
                sums = tirx.Ramp(0, 1, lanes)
                T.buffer_store(row_sum, row_sum[ii, sums] + e, [ii, sums])
                return
            with T.vectorized(0, lanes) as lane:
                column = v * lanes + lane
                e = softmax_exp(scores[ii, column] - peak)
                T.buffer_store(scores, tirx.Select(column < length, e, zero) if masked else e, [ii, column])
                T.buffer_store(row_sum, row_sum[ii, lane] + scores[ii, column], [ii, lane])

        with T.serial(0, length // lanes) as v:
            exponentials(v, False)
        with T.If(length % lanes > 0):
            with T.Then():
                exponentials(length // lanes, True)


def _transposed(rows: list) -> list:
    """The columns of the square matrix whose rows are the vectors ``rows`` (as many as their
    lanes, a power of two): one bit of (vector, lane) swapped a stage, each new vector a shuffle
    of two (one ``vpermt2d``), so 16 x 16 words take 64 shuffles."""
    vectors, bit, lanes = list(rows), 1, len(rows)

    def shuffled(a, b, picks: list[int]):
        return T.bind(tirx.Shuffle([a, b], [tirx.const(i, "int32") for i in picks]))

    while bit < lanes:
        for v in (v for v in range(lanes) if not v & bit):
            a, b = vectors[v], vectors[v | bit]
            vectors[v] = shuffled(a, b, [lanes + (lane & ~bit) if lane & bit else lane for lane in range(lanes)])
            vectors[v | bit] = shuffled(a, b, [lanes + lane if lane & bit else lane | bit for lane in range(lanes)])
        bit <<= 1
    return vectors


def _lane_reduce(lanes_buffer, row, lanes: int, combine) -> tirx.Expr:
    """The ``lanes`` values of ``lanes_buffer[row]`` combined (``tirx.max`` or ``tirx.Add``)."""
    value = lanes_buffer[row, 0]
    for lane in range(1, lanes):
        value = combine(value, lanes_buffer[row, lane])
    return value


def _tile_loop(rows: int, columns: int, lanes: int, store) -> None:
    """``store(ii, jv, lane)`` over a register tile: rows unrolled, columns as unrolled whole
    vectors (column ``jv * lanes + lane``)."""
    with T.unroll(0, rows) as ii:
        with T.unroll(0, columns // lanes) as jv:
            with T.vectorized(0, lanes) as lane:
                store(ii, jv, lane)


__all__ = ["VARLEN_ATTENTION", "varlen_attention"]
