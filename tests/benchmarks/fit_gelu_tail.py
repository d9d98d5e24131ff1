"""Fits the GELU's normal tail (``dietserve/kernels/tir/gelu.py``): ``sqrt(Phi(-u)) ~ P(u) / Q(u)``
on [0, TAIL_END], and prints the coefficients as float32 values, lowest degree first, with the
fit's error in float64. Not a test; rerun it to check or change ``TAIL_P`` / ``TAIL_Q``.

    python tests/benchmarks/fit_gelu_tail.py            # degrees 7 and 7, the ones in use

Iteratively reweighted linear least squares: Sanathanan-Koerner (each pass divides the
linearised residual ``P - f Q`` by the last pass's ``Q``), then Lawson's weights, which move
the error towards equal ripple. The tolerance is what the float32 GELU can afford: its error
from the tail is ``u * |tail error|``, to stay under the rounding of the result (half an ulp of
``u``) within 2.6e-7, and relatively 1.5e-3 where the GELU of a negative ``u`` is above 1e-6.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from scipy.special import ndtr

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dietserve.kernels.tir.gelu import TAIL_END, numpy_normal_tail  # noqa: E402

POWER = 2  # the rational fits the tail's square root, as gelu.py squares it (``numpy_normal_tail``)


def tail_tolerance(u: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """The error in ``Phi(-u)`` the float32 GELU affords at each ``u``."""
    half_ulp = 0.5 * np.spacing(np.maximum(u, 1e-3).astype(np.float32)).astype(np.float64)
    tolerance = np.minimum(2.0e-7, np.maximum(2.6e-7 - half_ulp, 1.5e-8) / np.maximum(u, 1e-3))
    return np.where(u * tail > 1e-6, np.minimum(tolerance, 1.5e-3 * tail), tolerance)


def fit(p_degree: int, q_degree: int, end: float, passes: int = 200) -> tuple[np.ndarray, np.ndarray, float]:
    """(P, Q with Q(0) = 1, max error / tolerance) of the best pass."""
    u = np.linspace(0, end, 20001)
    tail = ndtr(-u)
    target = tail ** (1.0 / POWER)
    # the root's tolerance: d(root^POWER) = POWER * root^(POWER - 1) * d(root)
    tolerance = tail_tolerance(u, tail) / (POWER * np.maximum(tail, 1e-300) ** ((POWER - 1.0) / POWER))
    tolerance = np.minimum(tolerance, 0.2 * target)
    powers = u[:, None] ** np.arange(max(p_degree, q_degree) + 1)
    columns = np.hstack([powers[:, :p_degree + 1], -(target[:, None] * powers[:, 1:q_degree + 1])])
    weights, q_values, best = 1 / tolerance, np.ones_like(u), None
    for index in range(passes):
        scale = weights / np.abs(q_values)
        scale = scale / scale.max()
        solution, *_ = np.linalg.lstsq(columns * scale[:, None], target * scale, rcond=None)
        p, q = solution[:p_degree + 1], np.concatenate([[1.0], solution[p_degree + 1:]])
        q_values = np.polyval(q[::-1], u)
        error = np.abs(np.polyval(p[::-1], u) / q_values - target) / tolerance
        if q_values.min() > 0 and (best is None or error.max() < best[2]):
            best = (p, q, error.max())
        if index >= 5:
            weights = weights * (error / error.max()) ** 0.5 + 1e-300
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--p-degree", type=int, default=7)
    parser.add_argument("--q-degree", type=int, default=7)
    args = parser.parse_args()
    p, q, worst = fit(args.p_degree, args.q_degree, TAIL_END)
    p32, q32 = p.astype(np.float32), q.astype(np.float32)
    u = np.linspace(0, TAIL_END, 600001)
    tail = numpy_normal_tail(u, p32, q32)
    relative = np.abs(tail / ndtr(-u) - 1)
    print(f"max error / tolerance {worst:.3f}; float32 coefficients in float64: relative error "
          f"{relative[u <= 3].max():.2g} (u <= 3), {relative[u <= 4].max():.2g} (u <= 4), {relative.max():.2g} "
          f"(u <= {TAIL_END:g}); u * |error| at most {(u * np.abs(tail - ndtr(-u))).max():.2g}")
    print(f"TAIL_P = {tuple(float(c) for c in p32)}")
    print(f"TAIL_Q = {tuple(float(c) for c in q32)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
