"""Softmax over the last axis, as loops the IR builder emits into a kernel: the masked softmax
of attention computed on rows the scores kernel has just written (still in cache), in place.

It evaluates what the model's unfused softmax does (TOPI's ``fast_softmax``: ``e = fast_exp(x -
max)``, ``e / sum(e)``), with TOPI's own ``fast_exp`` arithmetic (``softmax_exp``: the same
values where ``x - max <= 0``), so fusing it changes no number beyond the summation order.
``is_last_axis_softmax`` recognises that PrimFunc by structure, for the pass that fuses it
(``compile/passes/fuse_softmax.py``).
"""

from __future__ import annotations

import tvm_ffi
from tvm import te, tirx, topi
from tvm.script.ir_builder import tirx as T

from .fast_exp import softmax_exp

LOWEST = -3.4028234663852886e38  # float32's lowest: the max's start, as TOPI's softmax has it


def softmax_rows(out, row_index, rows, columns, lanes: int) -> None:
    """In place on ``out``: for each of ``rows`` rows (``row_index(r)`` gives its leading
    indices), ``x <- fast_exp(x - max) / sum``; whole vectors, then the < ``lanes`` tail."""
    dtype = out.dtype
    vectors = tirx.floordiv(columns, lanes)
    tail_start = vectors * lanes
    with T.serial(0, rows) as r:
        index = row_index(r)
        lane_acc = T.alloc_buffer((lanes,), dtype, scope="local")
        total = T.alloc_buffer((1,), dtype, scope="local")
        # the row's max
        with T.vectorized(0, lanes) as lane:
            T.buffer_store(lane_acc, tirx.const(LOWEST, dtype), [lane])
        with T.serial(0, vectors) as v:
            with T.vectorized(0, lanes) as lane:
                T.buffer_store(lane_acc, tirx.max(lane_acc[lane], out[(*index, v * lanes + lane)]), [lane])
        T.buffer_store(total, tirx.const(LOWEST, dtype), [0])
        with T.unroll(0, lanes) as lane:
            T.buffer_store(total, tirx.max(total[0], lane_acc[lane]), [0])
        with T.serial(0, columns - tail_start) as t:
            T.buffer_store(total, tirx.max(total[0], out[(*index, tail_start + t)]), [0])
        row_max = T.alloc_buffer((1,), dtype, scope="local")
        T.buffer_store(row_max, total[0], [0])
        # exponentials, and their sum
        with T.vectorized(0, lanes) as lane:
            T.buffer_store(lane_acc, tirx.const(0, dtype), [lane])
        with T.serial(0, vectors) as v:
            with T.vectorized(0, lanes) as lane:
                e = softmax_exp(out[(*index, v * lanes + lane)] - row_max[0])
                T.buffer_store(out, e, [*index, v * lanes + lane])
                T.buffer_store(lane_acc, lane_acc[lane] + out[(*index, v * lanes + lane)], [lane])
        T.buffer_store(total, tirx.const(0, dtype), [0])
        with T.unroll(0, lanes) as lane:
            T.buffer_store(total, total[0] + lane_acc[lane], [0])
        with T.serial(0, columns - tail_start) as t:
            T.buffer_store(out, softmax_exp(out[(*index, tail_start + t)] - row_max[0]), [*index, tail_start + t])
            T.buffer_store(total, total[0] + out[(*index, tail_start + t)], [0])
        # normalised
        with T.serial(0, vectors) as v:
            with T.vectorized(0, lanes) as lane:
                T.buffer_store(out, out[(*index, v * lanes + lane)] / total[0], [*index, v * lanes + lane])
        with T.serial(0, columns - tail_start) as t:
            T.buffer_store(out, out[(*index, tail_start + t)] / total[0], [*index, tail_start + t])


def is_last_axis_softmax(func: tirx.PrimFunc) -> bool:
    """Whether ``func`` is ``fast_softmax`` over the last axis of its one input (what the
    model's ``FastSoftmax`` pass legalises to), by structure, whatever its shape vars."""
    params = [p for p in func.params if isinstance(p.ty, tirx.buffer.BufferType)]
    if len(params) != 2 or len(func.params) != 2:
        return False
    shape = list(params[0].ty.shape)
    if [str(d) for d in params[1].ty.shape] != [str(d) for d in shape]:
        return False
    dtype = str(params[0].ty.dtype)
    if dtype != str(params[1].ty.dtype) or not dtype.startswith("float") or not shape:
        return False
    x = te.placeholder(shape, dtype, name="x")
    reference = te.create_prim_func([x, topi.nn.fast_softmax(x, axis=len(shape) - 1)], index_dtype_override="int64")
    return tvm_ffi.structural_equal(reference.body, func.body, map_free_vars=True)
