"""The compiled GELU (``dietserve/kernels/tir/gelu.py``) against the exact one (scipy, float64):
its error beside the textbook float32 formula with a correctly rounded erf and PyTorch's CPU
GELU, and the time of one vector of it on its own. Not a test (``tests/unit/test_gelu.py``
holds the bounds); prints a table.

    python tests/benchmarks/gelu_accuracy.py [--mcpu znver3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import tvm
from scipy.special import erf

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.unit.test_gelu import compiled_gelu  # noqa: E402
from tuner.targets import resolve_target  # noqa: E402


def errors(got: np.ndarray, v: np.ndarray, exact: np.ndarray) -> tuple[float, float, float]:
    """(max absolute error, max relative error for v > 0 in float32 ulps, max relative error
    for v < 0 where the GELU is above 1e-6 in size)."""
    error = np.abs(got.astype(np.float64) - exact)
    above, below = v > 0, (v < 0) & (np.abs(exact) > 1e-6)
    return (error.max(), (error[above] / exact[above]).max() / np.finfo(np.float32).eps,
            (error[below] / np.abs(exact[below])).max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mcpu", help="build for this CPU (default this one's)")
    args = parser.parse_args()
    where = resolve_target("llvm", mcpu=args.mcpu)
    mcpu, lanes = where.target["mcpu"], where.hardware.lanes(32)

    v = np.linspace(-12, 12, 480_001).astype(np.float32)
    v64 = v.astype(np.float64)
    exact = 0.5 * v64 * (1 + erf(v64 / np.sqrt(2)))
    ours = tvm.runtime.tensor(np.zeros_like(v))
    compiled_gelu(mcpu, lanes=lanes)["main"](tvm.runtime.tensor(v), ours)
    rows = {"ours": ours.numpy()}
    half, one = np.float32(0.5), np.float32(1)
    rows["textbook, rounded erf"] = half * v * (one + erf((v * np.float32(1 / np.sqrt(2))).astype(np.float64))
                                                .astype(np.float32))
    try:
        import torch

        rows["PyTorch CPU"] = torch.nn.functional.gelu(torch.from_numpy(v)).numpy()
    except ImportError:
        pass
    print(f"GELU on [-12, 12] ({v.size} points), {mcpu}, {lanes} lanes")
    print(f"{'':>22} {'max abs':>10} {'v > 0, ulps':>12} {'v < 0, rel':>11}")
    for name, got in rows.items():
        absolute, above, below = errors(got, v, exact)
        print(f"{name:>22} {absolute:>10.3g} {above:>12.2f} {below:>11.3g}")

    length = 4096  # in L1: the arithmetic alone
    x = tvm.runtime.tensor(np.random.default_rng(0).standard_normal(length).astype(np.float32))
    y = tvm.runtime.tensor(np.zeros(length, np.float32))
    timer = compiled_gelu(mcpu, length=length, lanes=lanes).jit().time_evaluator("main", tvm.cpu(0), number=2000,
                                                                                 repeat=7)
    seconds = float(np.median(timer(x, y).results))
    print(f"one {lanes}-lane vector: {seconds * 1e9 / (length / lanes):.2f} ns (median of 7 x 2000 calls over "
          f"{length} elements)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
