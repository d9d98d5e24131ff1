"""Exact-erf GELU in float32 vector arithmetic, computed through erfc so nothing cancels.

LLVM lowers ``erf`` to a scalar libm call per element, which made the hidden->intermediate
dense layer cost up to 2x the same-FLOP intermediate->hidden one. Here, with ``a = |v| / sqrt(2)``:

    GELU(v) = v - v/2 * erfc(a)    (v >= 0)        GELU(v) = v/2 * erfc(a)    (v < 0)

which is ``v/2 * (1 + erf(v / sqrt(2)))`` without forming ``1 + erf`` (for negative ``v`` that
sum cancels: a float32 ``erf`` near -1 leaves only a few correct bits in it). ``erfc`` is
``t * exp(P(t) - a^2)``, ``t = 1 / (1 + a/2)``, ``P`` of degree 9 fitted by iteratively
reweighted least squares to ``ln(erfc(a) * exp(a^2) / t)`` on a in [0, 10] (the form of
Numerical Recipes' ``erfcc``; our own fit): relative error 1e-7 with float32 coefficients,
the exp being TOPI's vectorisable ``fast_exp``. Evaluated in float32 the GELU is within 2.4e-7
of the exact one on [-12, 12] and within a few ulps of it everywhere, closer than a correctly
rounded ``erff`` put into the textbook formula (4.5e-7) and than PyTorch's CPU GELU (1.2e-6).

It replaced a float64 rational of erf (degrees 10 and 9, error 6e-11) whose float64 arithmetic,
8 lanes a register, took 10% of the 768->3072 + GELU layer's time at every T.
"""

from __future__ import annotations

import math

from tvm import tirx

from .fast_exp import fast_exp

# P(t), lowest degree first.
ERFC_P = (-1.2654414176940918, 0.9984931945800781, 0.38789117336273193, 0.028410684317350388, 0.020001141354441643,
          -0.11635094881057739, -0.6518598198890686, 1.1229221820831299, -0.6663104295730591, 0.1422443389892578)


def _f32(value: float) -> tirx.Expr:
    return tirx.const(value, "float32")


def _horner(coefficients, t):
    result = _f32(coefficients[-1])
    for c in reversed(coefficients[:-1]):
        result = result * t + _f32(c)
    return result


def _let(name: str, value, body):
    """``body(x)`` with ``x`` bound to ``value`` once: an expression used several times stays one
    node, where a tree would copy it into every use (the GELU's tree grew 12x the compile time)."""
    var = tirx.Var(name, "float32")
    return tirx.Let(var, value, body(var))


def _inline(_name: str, value, body):
    """``body(value)``: ``value`` written at each use, the same arithmetic as ``_let`` (LLVM
    merges the copies), for tools that cannot walk a ``Let`` (MetaSchedule's FLOP estimate)."""
    return body(value)


def erfc_expr(a, bind: bool = True):
    """erfc of a float32 TIR expression ``a >= 0``, vectorisable, relative error ~1e-7;
    ``bind``: shared subexpressions bound once (``_let``), else written as a tree (``_inline``)."""
    let = _let if bind else _inline
    return let("erfc_a", a, lambda a: let(
        "erfc_t", _f32(1.0) / (_f32(1.0) + _f32(0.5) * a), lambda t: let(
            "erfc_exponent", _horner(ERFC_P, t) - a * a, lambda exponent: t * fast_exp(exponent))))


def gelu_expr(v, bind: bool = True):
    """0.5 * v * (1 + erf(v / sqrt(2))), as Relax's legalization defines it, in float32 vectors;
    ``bind`` as for ``erfc_expr``."""
    let = _let if bind else _inline
    return let("gelu_v", v, lambda v: let(
        "gelu_half_v_erfc", _f32(0.5) * v * erfc_expr(tirx.abs(v) * _f32(1.0 / math.sqrt(2.0)), bind),
        lambda h: tirx.Select(v >= _f32(0.0), v - h, h)))


def numpy_erfc(a):
    """The same approximation in numpy, in float64: its approximation error without float32's."""
    import numpy as np

    a = np.asarray(a, dtype=np.float64)
    t = 1.0 / (1.0 + 0.5 * a)
    return t * np.exp(np.polyval(ERFC_P[::-1], t) - a * a)
