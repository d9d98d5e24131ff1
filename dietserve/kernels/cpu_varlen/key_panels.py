"""What a (head, sequence) task of the packed attention copies from the QKV block before its
products: K^T in ``[head_dim, nr]`` panels and V's rows, as fp32. The panels are contiguous: a
``[head_dim, L]`` array's rows would alias in L1 when L is a power of two, as the scores'
reduction walks down them. V's rows are copied contiguous too: in the QKV block they lie ``3 *
heads * head_dim`` floats apart, a page or more each. The bf16 products (``paired.py``) make
their pairs with the same transposition."""

from __future__ import annotations

from collections.abc import Callable

from tvm import tirx
from tvm.script.ir_builder import tirx as T


def copied_keys(qkv, start, length, k_column, key_columns: int, head_dim: int, nr: int, lanes: int):
    """K^T in ``nr``-column panels, zero up to whole panels (stack arrays: scope "global").
    ``lanes`` keys by ``lanes`` columns at a time transposed in registers where the head's columns
    are whole vectors, element by element where not."""
    keys = T.alloc_buffer((key_columns // nr, head_dim, nr), "float32", scope="global")
    if head_dim % lanes == 0:
        transposed_panels(keys, length, nr, lanes, head_dim // lanes, "float32", lambda row, block: qkv[
            start + row, tirx.Ramp(k_column + block * lanes, 1, lanes)])
        return keys
    with T.serial(0, length) as j:
        with T.serial(0, head_dim) as d:
            T.buffer_store(keys, qkv[start + j, k_column + d], [j // nr, d, j % nr])
    with T.serial(0, (length + nr - 1) // nr * nr - length) as j:  # zeros up to whole panels: scores not read
        with T.serial(0, head_dim) as d:
            T.buffer_store(keys, tirx.const(0, "float32"), [(length + j) // nr, d, (length + j) % nr])
    return keys


def copied_values(qkv, start, length, v_column, key_columns: int, head_dim: int):
    """V's rows, contiguous."""
    values = T.alloc_buffer((key_columns, head_dim), "float32", scope="global")
    with T.serial(0, length) as j:
        with T.vectorized(0, head_dim) as d:
            T.buffer_store(values, qkv[start + j, v_column + d], [j, d])
    return values


def transposed_panels(panels, length, nr: int, lanes: int, blocks: int, dtype: str,
                      row_of: Callable[[tirx.Expr, int], tirx.Expr]) -> None:
    """``panels[key // nr, block * lanes + c, key % nr]`` = lane ``c`` of ``row_of(key, block)``
    (a ``lanes``-wide vector of key ``key``'s row) for ``blocks`` blocks, keys past ``length`` as
    zeros up to whole panels: ``lanes`` keys' rows at a time transposed in registers
    (``transposed``) and stored whole."""
    zeros = tirx.Broadcast(tirx.const(0, dtype), lanes)
    with T.serial(0, (length + nr - 1) // nr * (nr // lanes)) as group:
        for block in range(blocks):
            rows = []
            for i in range(lanes):
                key = group * lanes + i
                row = row_of(tirx.min(key, length - 1), block)  # (a key past the end reads the last one)
                rows.append(T.bind(tirx.Select(tirx.Broadcast(key < length, lanes), row, zeros)))
            for column, vector in enumerate(transposed(rows)):
                T.buffer_store(panels, vector, [group * lanes // nr, block * lanes + column,
                                                tirx.Ramp(group * lanes % nr, 1, lanes)])


def transposed(rows: list) -> list:
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


__all__ = ["copied_keys", "copied_values", "transposed", "transposed_panels"]
