"""The packed attention's softmax over a tile of query rows: each row's max, reduced across the
lanes it was kept in, and exp(score - max) summed lane by lane. The exp is ``avx512_softmax_exp``
on 16-lane (AVX-512) tiles, the fused softmax's ``softmax_exp`` on others."""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from ..tir.fast_exp import AVX512_LANES, avx512_softmax_exp, softmax_exp


def exponentials(scores, row_max, row_sum, mr: int, lanes: int, length, first=0) -> None:
    """exp(score - row max) in place, summed lane by lane into ``row_sum``: whole vectors, then
    the last part vector (0 past the real columns, within the panels); columns ``first`` (whole
    vectors) to ``length``."""
    zero = tirx.const(0, "float32")
    with T.unroll(0, mr) as ii:
        peak = lane_reduce(row_max, ii, lanes, tirx.max)

        def pass_over(v, masked: bool) -> None:
            if lanes == AVX512_LANES:
                e = vector_exponentials(scores, ii, v * lanes, lanes, tirx.Broadcast(peak, lanes), length, masked)
                T.buffer_store(scores, e, [ii, tirx.Ramp(v * lanes, 1, lanes)])
                sums = tirx.Ramp(0, 1, lanes)
                T.buffer_store(row_sum, row_sum[ii, sums] + e, [ii, sums])
                return
            with T.vectorized(0, lanes) as lane:
                column = v * lanes + lane
                e = softmax_exp(scores[ii, column] - peak)
                T.buffer_store(scores, tirx.Select(column < length, e, zero) if masked else e, [ii, column])
                T.buffer_store(row_sum, row_sum[ii, lane] + scores[ii, column], [ii, lane])

        with T.serial(first // lanes, length // lanes) as v:
            pass_over(v, False)
        with T.If(length % lanes > 0):
            with T.Then():
                pass_over(length // lanes, True)


def vector_exponentials(scores, row, first, lanes: int, peak, length, masked: bool) -> tirx.Var:
    """exp(score - ``peak``) of ``scores[row]``'s ``lanes`` columns from ``first``, by
    ``avx512_softmax_exp``, as a bound vector; ``masked``: 0 at the columns past ``length``."""
    columns = tirx.Ramp(tirx.Cast("int64", first), tirx.const(1, "int64"), lanes)
    e = avx512_softmax_exp(scores[row, columns] - peak)
    if masked:
        e = tirx.Select(columns < tirx.Broadcast(tirx.Cast("int64", length), lanes), e,
                        tirx.Broadcast(tirx.const(0, "float32"), lanes))
    return T.bind(e)


def lane_reduce(lanes_buffer, row, lanes: int, combine) -> tirx.Expr:
    """The ``lanes`` values of ``lanes_buffer[row]`` combined (``tirx.max`` or ``tirx.Add``)."""
    value = lanes_buffer[row, 0]
    for lane in range(1, lanes):
        value = combine(value, lanes_buffer[row, lane])
    return value


__all__ = ["exponentials", "lane_reduce", "vector_exponentials"]
