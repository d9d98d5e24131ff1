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


# TOPI's constants (``topi.fast_exp``), so that ``softmax_exp`` computes its values bit for bit.
_LOWEST_INPUT, _LOG2E, _LN2 = -88.37625885009765625, 1.44269502162933349609375, 0.693147182464599609375
_TAYLOR = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def softmax_exp(value: tirx.Expr) -> tirx.Expr:
    """``fast_exp`` of a ``value`` known to be at most 0 (a score less its row's max): the same
    range reduction and polynomial, without the upper clamp and the final ``max(e, x)``, which
    change nothing there and cost two of its vector operations."""
    dtype = "float32"

    def const(number: float) -> tirx.Expr:
        return tirx.const(number, dtype)

    x = tirx.max(value, const(_LOWEST_INPUT))
    n = tirx.floor(x * const(_LOG2E) + const(0.5))
    r = x - n * const(_LN2)
    poly = const(_TAYLOR[0])
    for coefficient in _TAYLOR[1:]:
        poly = poly * r + const(coefficient)
    scale = tirx.reinterpret(dtype, tirx.Cast("int32", n + const(127.0)) << tirx.const(23, "int32"))
    return scale * (poly * r * r + r + const(1.0))
