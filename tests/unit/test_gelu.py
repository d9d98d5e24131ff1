"""The vectorised exact-erf GELU: its erf is as accurate as float32 holds (scipy's erf is the
reference), its rational has no pole on the range, and the compiled kernel vectorises."""

from __future__ import annotations

import numpy as np
import tvm
from scipy.special import erf
from tvm import te

from dietserve.kernels.gelu import ERF_CLAMP, ERF_Q, gelu_expr, numpy_erf


def test_erf_approximation_is_far_below_float32_resolution() -> None:
    x = np.linspace(-ERF_CLAMP, ERF_CLAMP, 800_001)
    assert np.abs(numpy_erf(x) - erf(x)).max() < 1e-10  # float32's half-ulp at 1 is 3e-8
    beyond = np.linspace(ERF_CLAMP, 12, 10_001)  # clamped: erf(4) is 1 - 1.5e-8, which rounds to 1
    assert (np.abs(numpy_erf(beyond) - erf(beyond)) < np.finfo(np.float32).eps / 4).all()
    assert (numpy_erf(beyond).astype(np.float32) == np.float32(1)).all()
    s = np.linspace(0, ERF_CLAMP**2 / 16, 100_001)
    assert (np.polyval(ERF_Q[::-1], s) > 0.5).all()  # no pole on [-4, 4]


def _compiled_gelu(target: dict):
    n = te.var("n", "int64")
    x = te.placeholder((n,), "float32", name="x")
    y = te.compute((n,), lambda i: gelu_expr(x[i]), name="gelu")
    func = te.create_prim_func([x, y]).with_attr("global_symbol", "main")
    sch = tvm.s_tir.Schedule(func)
    (loop,) = sch.get_loops(sch.get_sblock("gelu"))
    _, lanes = sch.split(loop, [None, 8])
    sch.vectorize(lanes)
    return tvm.compile(sch.mod, tvm.target.Target(target))


def test_compiled_gelu_matches_exact_gelu_and_calls_no_libm_erf() -> None:
    executable = _compiled_gelu({"kind": "llvm", "mcpu": "haswell"})
    v = np.linspace(-12, 12, 480_001).astype(np.float32)
    out = tvm.runtime.tensor(np.zeros_like(v))
    executable["main"](tvm.runtime.tensor(v), out)
    v64 = v.astype(np.float64)
    exact = 0.5 * v64 * (1 + erf(v64 / np.sqrt(2)))
    # float32 in, float32 out: within a couple of float32 roundings of the exact value
    assert np.abs(out.numpy() - exact).max() <= 4 * np.finfo(np.float32).eps * np.abs(exact).max()
    asm = executable.mod.inspect_source("asm")
    assert "erff" not in asm and "vdivpd" in asm  # vector arithmetic, no scalar libm calls
