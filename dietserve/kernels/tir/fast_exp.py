"""TOPI's vectorisable exp (``topi.fast_exp``: range reduction and a polynomial, no libm call),
as an expression to place inside any kernel: the fused softmax and the GELU use it."""

from __future__ import annotations

import functools

from tvm import te, tirx, topi

from .rebuild import rebuild


@functools.cache
def _fast_exp_template() -> tuple:
    x = te.placeholder((1,), "float32", name="x")
    func = te.create_prim_func([x, topi.fast_exp(x)])
    store = func.body.block.body.body.block.body  # root block -> loop -> block -> store
    return func.params[0], store.value


def fast_exp(value: tirx.Expr) -> tirx.Expr:
    """TOPI's vectorisable ``fast_exp`` of a float32 ``value``."""
    source, expr = _fast_exp_template()
    return rebuild(expr, {}, {source: value})
