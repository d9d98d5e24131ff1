"""Exact-erf GELU in float32 vector arithmetic: no libm call, no exp, nothing that cancels.

LLVM lowers ``erf`` to a scalar libm call per element, which would make a dense layer with a
GELU epilogue far slower than the same FLOPs without it. Here, with ``u = |v|`` and
``Phi`` the standard normal CDF, ``GELU(v) = v * Phi(v)`` is

    GELU(v) = v - v * Phi(-u)    (v >= 0)        GELU(v) = v * Phi(-u)    (v < 0)

which is ``v/2 * (1 + erf(v / sqrt(2)))`` without forming ``1 + erf`` for negative ``v`` (that
sum cancels: a float32 ``erf`` near -1 leaves only a few correct bits in it). The tail
``Phi(-u)`` is ``(P(u) / Q(u))^2`` on ``u`` in [0, 6], ``P`` and ``Q`` of degree 7: squaring
halves the decay the rational has to follow (``Phi(-6)`` is 1e-9, its square root 3e-5), so
it follows it without cancelling, and amplifies the rational's rounding only twice. Past
``u = 6`` the tail is held at ``Phi(-6)``, and ``v`` at -6 in the product, so the GELU of
any ``v < -6`` is -5.9e-9 (the exact one is closer to 0 than that). Our own fit
(``tests/benchmarks/fit_gelu_tail.py``): iteratively reweighted linear least squares
(Sanathanan-Koerner, then Lawson's weights) of ``sqrt(Phi(-u))``, weighted so that the float32
GELU stays within its rounding of the exact one (``tests/unit/test_gelu.py`` holds the bounds;
``tests/benchmarks/gelu_accuracy.py`` compares it with other forms). It costs 23 vector
operations and one division.
"""

from __future__ import annotations

from tvm import tirx

# sqrt(Phi(-u)) ~ P(u) / Q(u) on [0, TAIL_END]; float32 values, lowest degree first.
TAIL_P = (0.7071067690849304, -0.4007243812084198, 0.0725664421916008, -0.0012948352377861738,
          -0.000900564540643245, 4.7010536945890635e-05, 6.731110261171125e-06, -5.266264793135633e-07)
TAIL_Q = (1.0, -0.16776752471923828, 0.1152712032198906, -0.003931107930839062, 0.0014401735970750451,
          0.0011093945940956473, -0.0001573339250171557, 3.561125777196139e-05)
TAIL_END = 6.0


def _f32(value: float) -> tirx.Expr:
    return tirx.const(value, "float32")


def _horner(coefficients, x):
    result = _f32(coefficients[-1])
    for c in reversed(coefficients[:-1]):
        result = result * x + _f32(c)
    return result


def _let(name: str, value, body):
    """``body(x)`` with ``x`` bound to ``value`` once: an expression used several times stays one
    node, where a tree would copy it into every use (and multiply the compile time)."""
    var = tirx.Var(name, "float32")
    return tirx.Let(var, value, body(var))


def _inline(_name: str, value, body):
    """``body(value)``: ``value`` written at each use, the same arithmetic as ``_let`` (LLVM
    merges the copies), for tools that cannot walk a ``Let`` (MetaSchedule's FLOP estimate)."""
    return body(value)


def normal_tail_expr(u, bind: bool = True):
    """``Phi(-u)`` of a float32 TIR expression ``u >= 0`` (NaN stays NaN), vectorisable;
    ``bind``: shared subexpressions bound once (``_let``), else written as a tree (``_inline``)."""
    let = _let if bind else _inline
    end = _f32(TAIL_END)
    # ``u > end ? end : u``, not ``min``: LLVM's minnum would turn a NaN into ``end``.
    return let("tail_u", tirx.Select(u > end, end, u), lambda u: let(
        "tail_root", _horner(TAIL_P, u) / _horner(TAIL_Q, u), lambda root: root * root))


def gelu_expr(v, bind: bool = True):
    """0.5 * v * (1 + erf(v / sqrt(2))), as Relax's legalization defines it, in float32 vectors;
    ``bind`` as for ``normal_tail_expr``."""
    let = _let if bind else _inline

    def gelu(v):
        above = v >= _f32(0.0)
        # One product, added once: ``v - v * tail`` above 0 rounds once (a fused multiply-add),
        # where ``v * (1 - tail)`` rounded twice (3.8e-7 off near v = 5).
        factor = tirx.Select(above, -v, tirx.max(v, _f32(-TAIL_END)))
        return factor * normal_tail_expr(tirx.abs(v), bind) + tirx.Select(above, v, _f32(0.0))

    return let("gelu_v", v, gelu)


def numpy_normal_tail(u, p=TAIL_P, q=TAIL_Q):
    """The same approximation in numpy, in float64: its approximation error without float32's
    (``p``, ``q``: other coefficients of the same form, as ``fit_gelu_tail.py`` checks a fit)."""
    import numpy as np

    u = np.minimum(np.asarray(u, dtype=np.float64), TAIL_END)
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    return (np.polyval(p[::-1], u) / np.polyval(q[::-1], u)) ** 2
