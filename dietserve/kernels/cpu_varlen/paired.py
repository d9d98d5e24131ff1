"""The packed attention's two products on bf16 pairs (``kernels/cpu_packed/bf16.py``): the
scores over pairs of head_dim columns, the context over pairs of keys, one ``vdpbf16ps`` a
16-lane vector; the softmax and the sums stay fp32."""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from ..cpu_packed.bf16 import PAIR_LANES, adjacent_pairs, dot_pairs, pair
from .key_panels import copied_keys, transposed_panels
from .softmax import lane_reduce, vector_exponentials
from .tile import VarlenTile


class PairedProducts:
    """The two products of one (head, sequence) task on bf16 pairs (``kernels/cpu_packed/bf16.py``):
    the scores over pairs of head_dim columns, the context over pairs of keys. K^T's panels and
    V's rows are converted once per task, a tile's queries and exponentials once per tile; the
    running max, exp and sums stay fp32. A pair past the sequence's end holds zeros."""

    def __init__(self, tile: VarlenTile, head_dim: int, length, key_columns: int, score_columns: int):
        self.tile, self.length, self.half, self.key_columns = tile, length, head_dim // 2, key_columns
        mr, nr = tile.mr, tile.nr
        self.keys = T.alloc_buffer((key_columns // nr, self.half, nr), "uint32", scope="global")
        self.values = T.alloc_buffer(((key_columns + 1) // 2, head_dim), "uint32", scope="global")
        self.queries = T.alloc_buffer((mr, self.half), "uint32", scope="global")
        self.exponentials = T.alloc_buffer((mr, score_columns // 2), "uint32", scope="global")

    def copy_keys(self, qkv, start, k_column) -> None:
        """K^T's panels as pairs of head_dim columns, zero past the sequence's end up to whole
        panels. Where a head's pairs are whole vectors (head_dim a multiple of 32) straight from
        the QKV block: each key's row converted to pairs (one ``vcvtne2ps2bf16`` per 16 words),
        16 keys' rows transposed in registers (``transposed_panels``); elsewhere paired from the
        fp32 panels (``copied_keys``)."""
        lanes, nr = PAIR_LANES, self.tile.nr
        if self.half % lanes == 0:
            transposed_panels(self.keys, self.length, nr, lanes, self.half // lanes, "uint32", lambda row, block: (
                adjacent_pairs(*(qkv[start + row, tirx.Ramp(k_column + 2 * lanes * block + lanes * part, 1, lanes)]
                                 for part in (0, 1)))))
            return
        keys = copied_keys(qkv, start, self.length, k_column, self.key_columns, 2 * self.half, nr, lanes)
        with T.serial(0, (self.length + nr - 1) // nr) as jo:
            with T.serial(0, self.half) as d:
                with T.vectorized(0, nr) as j:
                    T.buffer_store(self.keys, pair(keys[jo, 2 * d, j], keys[jo, 2 * d + 1, j]), [jo, d, j])

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

    def exponentiate(self, scores, row_max, row_sum, first=0, end=None) -> None:
        """The tile's exponentials, exp(score - row max), summed in fp32 into ``row_sum`` and
        stored as pairs of keys: 32 keys (two vectors) a step, each converted by one
        ``vcvtne2ps2bf16``; the columns past the sequence's end (or ``end``) as zeros; from column
        ``first`` (whole steps). Their exp is ``avx512_softmax_exp`` (``vector_exponentials``):
        they are rounded to bf16 next."""
        lanes, end = PAIR_LANES, self.length if end is None else end
        whole = end // (2 * lanes)

        def step(ii, peak, u, masked: bool) -> None:
            halves = [vector_exponentials(scores, ii, column, lanes, peak, end, masked)
                      for column in (u * 2 * lanes, u * 2 * lanes + lanes)]
            sums = tirx.Ramp(tirx.const(0, "int32"), tirx.const(1, "int32"), lanes)
            T.buffer_store(row_sum, row_sum[ii, sums] + halves[0] + halves[1], [ii, sums])
            words = tirx.Ramp(tirx.Cast("int64", u * lanes), tirx.const(1, "int64"), lanes)
            T.buffer_store(self.exponentials, adjacent_pairs(*halves), [ii, words])

        with T.unroll(0, self.tile.mr) as ii:
            peak = T.bind(tirx.Broadcast(lane_reduce(row_max, ii, lanes, tirx.max), lanes))
            with T.serial(first // (2 * lanes), whole) as u:
                step(ii, peak, u, masked=False)
            with T.If(end % (2 * lanes) > 0):
                with T.Then():
                    step(ii, peak, whole, masked=True)

    def context(self, context, column0, nc: int, first=0, end=None) -> None:
        """``context`` (``mr x nc``) += the tile's exponentials times V's columns from ``column0``,
        over the keys from ``first`` (even) to the sequence's end (or ``end``)."""
        lanes, end = PAIR_LANES, self.length if end is None else end
        with T.serial(first // 2, (end + 1) // 2) as j:
            for ii in range(self.tile.mr):
                for cv in range(nc // lanes):
                    columns = tirx.Ramp(tirx.const(cv * lanes, "int32"), tirx.const(1, "int32"), lanes)
                    in_v = tirx.Ramp(column0 + cv * lanes, tirx.const(1, "int32"), lanes)
                    T.buffer_store(context, dot_pairs(context[ii, columns], self.exponentials[ii, j],
                                                      self.values[j, in_v]), [ii, columns])


__all__ = ["PairedProducts"]
