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


# exp(r) on |r| <= ln 2 / 2 by a degree-5 polynomial fitted for least relative error, exp(0) = 1
# exactly, lowest order first: at most 1.8e-7, as fine as TOPI's degree 7 (a degree 4, at 2.7e-6,
# already rounds some of attention's weights to the other bf16 and moves single tokens of a model).
_EXP_POLYNOMIAL = (1.0, 0.9999997019767761, 0.4999915063381195, 0.1666763573884964, 0.04189793020486832,
                   0.008290315046906471)
_SCALEF = "llvm.x86.avx512.mask.scalef.ps.512"
AVX512_LANES = 16  # float32 lanes of the vectors ``avx512_softmax_exp`` takes


def avx512_softmax_exp(vector: tirx.Expr) -> tirx.Expr:
    """exp of a float32x16 ``vector`` of values at most 0 (a score less its row's max):
    ``softmax_exp``'s range reduction, to nearest, with a polynomial of degree 5 in place of 7,
    and the power of two applied by one AVX-512 ``vscalefps`` (underflowing to 0 gracefully) in
    place of building it from its exponent bits: 10 vector operations, not 16."""
    lanes = vector.ty.dtype.lanes

    def const(number: float) -> tirx.Expr:
        return tirx.Broadcast(tirx.const(number, "float32"), lanes)

    x = tirx.max(vector, const(_LOWEST_INPUT))
    n = tirx.round(x * const(_LOG2E))
    r = x - n * const(_LN2)
    poly = const(_EXP_POLYNOMIAL[-1])
    for coefficient in reversed(_EXP_POLYNOMIAL[:-1]):
        poly = poly * r + const(coefficient)
    every_lane = tirx.const(-1, "int16")
    return tirx.call_llvm_pure_intrin(f"float32x{lanes}", _SCALEF, poly, n, poly, every_lane,
                                      tirx.const(4, "int32"))  # (4: the current rounding mode)
