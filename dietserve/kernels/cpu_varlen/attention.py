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
file, or tuned tiles behind a tree over each sequence's length, compiled in. The copies are
``key_panels.py``'s, the softmax ``softmax.py``'s, the bf16 products ``paired.py``'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from ..cpu_packed.bf16 import PAIR_LANES, PRECISION_ATTR, importing_bf16_functions
from ..plan.decision_tree import TreeError, check_tree
from ..tir.build import with_exact_buffers
from ..tir.computed_once import computed_once
from ..tir.row_softmax import LOWEST
from .key_panels import copied_keys, copied_values
from .paired import PairedProducts
from .softmax import exponentials, lane_reduce
from .tile import LENGTH_VAR, VarlenTile, context_tile

VARLEN_ATTENTION = "dietserve.varlen_attention"  # the PrimFunc attribute naming its (heads, head_dim)


Tiles = VarlenTile | Mapping[str, VarlenTile]


def varlen_attention(heads: int, head_dim: int, max_len: int, tiles: Tiles | None = None, tree: Mapping | None = None,
                     parallel: bool = True, precision: str = "fp32", relative_bias: bool = False,
                     window: int | None = None, causal: bool = False, kv_heads: int | None = None,
                     query_parts: int = 1) -> tirx.PrimFunc:
    """The PrimFunc ``(qkv [T, (heads + 2 * kv_heads) * head_dim], starts [B + 1] int64, out [T,
    heads * head_dim])``; ``max_len`` bounds a sequence's length (the position table's size);
    ``kv_heads`` (None: ``heads``): key and value heads, each read by ``heads / kv_heads`` query
    heads in turn (grouped-query attention, Qwen3's).
    ``relative_bias`` (MPNet's; ModernBERT's window): a ``bias [heads, 2 * max_len - 1]``
    argument after ``starts``, ``bias[h, j - i + max_len - 1]`` added to head h's score of query
    i for key j. ``window`` (with a bias that masks every key farther than ``window`` from its
    query, ModernBERT's sliding window): the key tiles wholly outside a query tile's window are
    skipped, in the scores, the softmax and the context (bf16: from the whole 32-key block
    holding the window's first key). ``causal`` (with a bias that masks every key after its
    query, a decoder's): the key tiles wholly after a query tile's last query are skipped alike.

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
    if (window is not None or causal) and not relative_bias:
        raise ValueError("a window or a causal mask skips key tiles that its bias masks: it needs relative_bias")
    if pairs and not all(bf16_attention_fits(tile, head_dim) for tile in tiles.values()):
        raise ValueError(f"bf16 attention needs {PAIR_LANES}-lane tiles and context tiles over an even head_dim; "
                         f"tiles {sorted(t.describe() for t in tiles.values())} for head_dim {head_dim} are not")
    width, kv_heads = heads * head_dim, heads if kv_heads is None else kv_heads
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not share {kv_heads} key and value heads evenly")
    tokens, segments = tirx.Var("tokens", "int64"), tirx.Var("segments", "int64")
    with IRBuilder() as builder:
        with T.prim_func():
            qkv = T.arg("qkv", T.Buffer((tokens, (heads + 2 * kv_heads) * head_dim), "float32"))
            starts = T.arg("starts", T.Buffer((segments,), "int64"))
            bias = T.arg("bias", T.Buffer((heads, 2 * max_len - 1), "float32")) if relative_bias else None
            out = T.arg("out", T.Buffer((tokens, width), "float32"))
            # scheduled as written: the default rules leave it alone
            T.func_attr({VARLEN_ATTENTION: [heads, head_dim], "tirx.is_scheduled": True})
            sequences = segments - 1
            loop = T.parallel if parallel else T.serial
            with loop(0, heads * sequences * query_parts) as task:
                part, pair = (0, task) if query_parts == 1 else computed_once(
                    tirx.floormod(task, query_parts), tirx.floordiv(task, query_parts))
                h, b = computed_once(tirx.floordiv(pair, sequences), tirx.floormod(pair, sequences))
                start, length = computed_once(starts[b], starts[b + 1] - starts[b])
                where = (h, start, length, (part, query_parts))
                _dispatch(tree, (qkv, out, where, (heads, kv_heads), head_dim, bias, max_len), tiles,
                          max_len, pairs, (window, causal))
    func = builder.get()
    if pairs:
        func = func.with_body(importing_bf16_functions(func.body)).with_attr(PRECISION_ATTR, precision)
    return with_exact_buffers(func, own_storage=True)


def query_parts_for(heads: int, cores: int | None) -> int:
    """Tasks per (head, sequence): one where the heads are a whole number of rounds of the
    cores; else enough that a lone sequence's tasks are (three heads on two cores ran as two
    rounds, the second on one core)."""
    if not cores or heads % cores == 0:
        return 1
    return cores // math.gcd(heads, cores)


def bf16_attention_fits(tile: VarlenTile, head_dim: int) -> bool:
    """Whether ``tile``'s products can run on bf16 pairs for ``head_dim``: 16-lane vectors in both
    (one ``vdpbf16ps`` a vector) and pairs of head_dim columns for the scores."""
    return tile.lanes == PAIR_LANES and context_tile(head_dim, tile)[1] == PAIR_LANES and head_dim % 2 == 0


def _dispatch(node: Mapping, call: tuple, tiles: Mapping[str, VarlenTile], longest: int, pairs: bool,
              reach: tuple[int | None, bool]) -> None:
    """The tree as nested ifs on the sequence's length; ``longest``: the most a leaf can see;
    ``reach``: the window and whether the mask is causal."""
    if "variant" in node:
        tile = tiles[node["variant"]]
        _sequence(*call, -(-longest // tile.nr) * tile.nr, tile, pairs, *reach)
        return
    if node["var"] != LENGTH_VAR:
        raise ValueError(f"an attention tree branches on {LENGTH_VAR!r} alone, not {node['var']!r}")
    length = call[2][2]
    with T.If(length <= node["le"]):
        with T.Then():
            _dispatch(node["then"], call, tiles, min(longest, max(int(node["le"]), 1)), pairs, reach)
        with T.Else():
            _dispatch(node["else"], call, tiles, longest, pairs, reach)


def _sequence(qkv, out, where, head_counts, head_dim, bias, max_len, key_columns, tile: VarlenTile,
              pairs: bool = False, window: int | None = None, causal: bool = False) -> None:
    """One head of one sequence; ``head_counts``: (query heads, key and value heads);
    ``pairs``: its products on bf16 pairs (``PairedProducts``);
    ``bias``: the relative position bias, or None; ``window``: keys farther from every query of a
    tile are skipped, ``causal``: keys after every query of a tile (whole key tiles: the bias
    masks the rest)."""
    h, start, length, (part, parts) = where
    heads, kv_heads = head_counts
    mr, nr, lanes = tile.mr, tile.nr, tile.lanes
    nc, context_lanes = context_tile(head_dim, tile)
    zero, lowest = tirx.const(0, "float32"), tirx.const(LOWEST, "float32")
    scale = tirx.const(1 / math.sqrt(head_dim), "float32")
    shared = h if kv_heads == heads else tirx.floordiv(h, heads // kv_heads)  # (the key and value head of h's group)
    q_column, k_column, v_column = h * head_dim, (heads + shared) * head_dim, (heads + kv_heads + shared) * head_dim
    key_tiles = (length + nr - 1) // nr
    # (scope "global": stack arrays, allocated once per task; "local" ones this size would go
    # through the runtime's workspace calls wherever they are declared)
    # (bf16: whole 32-column blocks, which ``PairedProducts.exponentiate`` converts at once)
    score_columns = -(-key_columns // (2 * PAIR_LANES)) * 2 * PAIR_LANES if pairs else key_columns
    scores = T.alloc_buffer((mr, score_columns), "float32", scope="global")
    queries = T.alloc_buffer((mr, head_dim), "float32", scope="global")
    row_max = T.alloc_buffer((mr, lanes), "float32", scope="global")
    row_sum = T.alloc_buffer((mr, lanes), "float32", scope="global")
    keys = values = paired = None
    if pairs:
        paired = PairedProducts(tile, head_dim, length, key_columns, score_columns)
        paired.copy_keys(qkv, start, k_column)
        paired.copy_values(qkv, start, v_column)
    else:
        keys = copied_keys(qkv, start, length, k_column, key_columns, head_dim, nr, lanes)
        values = copied_values(qkv, start, length, v_column, key_columns, head_dim)
    # (this task's share of the query tiles: all, or one of ``parts`` runs of them)
    query_tiles = (length + mr - 1) // mr
    first_query_tile, end_query_tile = 0, query_tiles
    if parts > 1:
        per_part = (query_tiles + parts - 1) // parts
        first_query_tile, end_query_tile = computed_once(
            part * per_part, tirx.max(tirx.min(query_tiles, part * per_part + per_part), part * per_part))
    with T.serial(first_query_tile, end_query_tile) as t:
        i0 = tirx.max(tirx.min(t * mr, length - mr), 0)
        rows = tirx.min(length, mr)
        with T.unroll(0, mr) as ii:
            with T.vectorized(0, head_dim) as d:
                T.buffer_store(queries, tirx.Select(ii < rows, qkv[start + i0 + tirx.min(ii, rows - 1), q_column + d]
                                                    * scale, zero), [ii, d])
            with T.vectorized(0, lanes) as lane:
                T.buffer_store(row_max, lowest, [ii, lane])
                T.buffer_store(row_sum, zero, [ii, lane])
        # the key tiles within reach of the tile's queries: all, or those a window reaches (up to
        # the last query's own, causal)
        first_tile, end_tile, first_column, end_column = 0, key_tiles, 0, length
        if window is not None:
            # from the key tile holding the window's first key (bf16: the whole block of 32 keys
            # holding it, as the exponentials are paired; the tile holding that block's start)
            block = 2 * PAIR_LANES if pairs else nr
            first_column = tirx.floordiv(tirx.max(i0 - window, 0), block) * block
            first_column, first_tile = computed_once(first_column, tirx.floordiv(first_column, nr))
        if window is not None or causal:
            after = 0 if causal else window
            (end_tile,) = computed_once(tirx.min(key_tiles, tirx.floordiv(i0 + rows - 1 + after, nr) + 1))
            end_column = tirx.min(end_tile * nr, length)
        # scores, and each row's running max over its real columns (lane by lane)
        if paired is not None:
            paired.pair_queries(queries)
        with T.serial(first_tile, end_tile) as jo:
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
                if bias is not None:  # (columns past the end, whose score is masked, read the last one's)
                    key = tirx.min(column, length - 1) if masked else column
                    score = score + bias[h, key - (i0 + tirx.min(ii, rows - 1)) + (max_len - 1)]
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
            paired.exponentiate(scores, row_max, row_sum, first_column, end_column)
        else:
            exponentials(scores, row_max, row_sum, mr, lanes, end_column, first_column)
        # context = (e @ V) / sum, the division folded into the store
        with T.unroll(0, head_dim // nc) as co:
            context = T.alloc_buffer((mr, nc), "float32", scope="global")
            _tile_loop(mr, nc, context_lanes, lambda ii, cv, lane: T.buffer_store(
                context, zero, [ii, cv * context_lanes + lane]))
            if paired is not None:
                paired.context(context, co * nc, nc, first_column, end_column)
            else:
                with T.serial(first_column, end_column) as j:
                    _tile_loop(mr, nc, context_lanes, lambda ii, cv, lane: T.buffer_store(
                        context, context[ii, cv * context_lanes + lane]
                        + scores[ii, j] * values[j, co * nc + cv * context_lanes + lane],
                        [ii, cv * context_lanes + lane]))
            with T.unroll(0, mr) as ii:
                with T.If(ii < rows):
                    with T.Then():
                        inverse = tirx.const(1, "float32") / lane_reduce(row_sum, ii, lanes, tirx.Add)
                        with T.vectorized(0, nc) as cc:
                            T.buffer_store(out, context[ii, cc] * inverse, [start + i0 + ii, q_column + co * nc + cc])


def _tile_loop(rows: int, columns: int, lanes: int, store) -> None:
    """``store(ii, jv, lane)`` over a register tile: rows unrolled, columns as unrolled whole
    vectors (column ``jv * lanes + lane``)."""
    with T.unroll(0, rows) as ii:
        with T.unroll(0, columns // lanes) as jv:
            with T.vectorized(0, lanes) as lane:
                store(ii, jv, lane)


__all__ = ["VARLEN_ATTENTION", "varlen_attention"]
