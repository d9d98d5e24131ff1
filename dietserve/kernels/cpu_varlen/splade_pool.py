"""SPLADE's pooling over packed sequences: one sparse vector of the vocabulary per sequence from
its tokens' masked-language-model logits, as sentence-transformers' ``SpladePooling`` computes it,
``reduce_t f(relu(logits[t]))`` with ``f`` ``log1p`` (``relu``) or ``log1p`` twice
(``log1p_relu``) and ``reduce`` a max or a sum over the sequence's tokens.

For the max, ``f`` and ``relu`` are monotone, so they apply once to each column's largest logit
rather than to every token's (T x vocab transcendental calls down to B x vocab); a sequence
without tokens reads 0, as padding does in sentence-transformers. The logits are read row after
row, each row's columns one after another (a row of the vocabulary is 120 KB: walking a column
down the rows would miss the cache at every token), in tasks of one sequence and one block of
columns, so a batch of one still splits over the cores.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from ..tir.build import with_exact_buffers

SPLADE_STRATEGIES = ("max", "sum")
SPLADE_ACTIVATIONS = ("relu", "log1p_relu")
_LANES = 16  # (LLVM splits a wider vector than the target has)
_COLUMNS = 1024  # a task's block of columns: its sums, 4 KB, stay in the first-level cache


def check_splade_pooling(strategy: str, activation: str) -> None:
    """A ValueError naming the setting unless SpladePooling's ``pooling_strategy`` and
    ``activation_function`` are ones this kernel computes."""
    for setting, value, known in (("pooling_strategy", strategy, SPLADE_STRATEGIES),
                                  ("activation_function", activation, SPLADE_ACTIVATIONS)):
        if value not in known:
            raise ValueError(f"SPLADE pooling {strategy!r} of {activation!r}: {setting} {value!r} is not supported; "
                             f"expected one of {', '.join(known)}")


def splade_pool(vocab: int, strategy: str = "max", activation: str = "relu", columns: int | None = None,
                parallel: bool = True) -> tirx.PrimFunc:
    """The PrimFunc ``(logits [T, columns], starts [B + 1] int64, out [B, vocab])``, the logits
    with the decoder's bias added;
    ``starts``: where each sequence's rows begin, the last entry T; ``columns`` (default
    ``vocab``): the logits' width, of which the first ``vocab`` are pooled."""
    check_splade_pooling(strategy, activation)
    columns = vocab if columns is None else columns
    if columns < vocab:
        raise ValueError(f"logits of {columns} columns cannot hold a vocabulary of {vocab}")
    tokens, segments, batch = tirx.Var("tokens", "int64"), tirx.Var("segments", "int64"), tirx.Var("batch", "int64")
    blocks = -(-vocab // _COLUMNS)
    zero = tirx.const(0, "float32")

    def transformed(x):
        once = tirx.log1p(x)
        return tirx.log1p(once) if activation == "log1p_relu" else once

    with IRBuilder() as builder:
        with T.prim_func():
            logits = T.arg("logits", T.Buffer((tokens, columns), "float32"))
            starts = T.arg("starts", T.Buffer((segments,), "int64"))
            out = T.arg("out", T.Buffer((batch, vocab), "float32"))
            T.func_attr({"tirx.is_scheduled": True})  # scheduled as written
            loop = T.parallel if parallel else T.serial
            with loop(0, batch * blocks) as task:
                b, first = tirx.floordiv(task, blocks), tirx.floormod(task, blocks) * _COLUMNS
                width = tirx.min(tirx.const(_COLUMNS, "int64"), vocab - first)
                with T.serial(0, width) as c:
                    T.buffer_store(out, zero, [b, first + c])
                with T.serial(starts[b], starts[b + 1]) as t:
                    def accumulate(c):
                        x = logits[t, first + c]
                        if strategy == "max":
                            T.buffer_store(out, tirx.max(out[b, first + c], x), [b, first + c])
                        else:
                            T.buffer_store(out, out[b, first + c] + transformed(tirx.max(x, zero)), [b, first + c])

                    _columns(width, accumulate)
                if strategy == "max":
                    with T.serial(0, width) as c:
                        T.buffer_store(out, transformed(out[b, first + c]), [b, first + c])
    return with_exact_buffers(builder.get())


def _columns(width, body) -> None:
    """``body(c)`` for ``c`` in ``0..width``: whole vectors of ``_LANES`` vectorised, then the rest."""
    with T.serial(0, tirx.floordiv(width, _LANES)) as v:
        with T.vectorized(0, _LANES) as lane:
            body(v * _LANES + lane)
    with T.serial(tirx.floordiv(width, _LANES) * _LANES, width) as c:
        body(c)
