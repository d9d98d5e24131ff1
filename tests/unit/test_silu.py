"""The vectorised SiLU (``compile/passes/vector_silu.py``): Relax's ``nn.silu`` replaced, compiled
through our pipeline's fast-math and default-schedule passes, against numpy's float64 SiLU, with
no libm call left."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from dietserve.compile.pipeline import default_schedule_pass, fast_math_passes, legalize_passes

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})


@pytest.fixture(scope="module")
def silu_module():
    builder = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4096,), "float32"))
    with builder.function("main", [x]):
        with builder.dataflow():
            y = builder.emit_output(relax.op.nn.silu(x))
        builder.emit_func_output(y)
    with TARGET:
        mod = tvm.transform.Sequential([*fast_math_passes(), *legalize_passes(), default_schedule_pass(TARGET)])(
            builder.get())
    return mod, tvm.compile(mod, TARGET)


def _silu(executable, x: np.ndarray) -> np.ndarray:
    return relax.VirtualMachine(executable, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()


def test_silu_is_numpys_within_float32_resolution(silu_module) -> None:
    _, executable = silu_module
    x = np.concatenate([np.linspace(-30, 30, 2048), np.random.default_rng(0).standard_normal(2048) * 4])
    x = x.astype(np.float32)
    exact = x.astype(np.float64) / (1 + np.exp(-x.astype(np.float64)))
    got = _silu(executable, x)
    # the polynomial exp is within a few ulps, the quotient one more: well inside 1e-6 relative
    assert np.abs(got - exact).max() <= 1e-6 * np.abs(exact).max()
    assert (np.abs(got - exact) <= 4e-7 * np.abs(exact) + 1e-30).all()


def test_silu_saturates_where_exp_overflows(silu_module) -> None:
    _, executable = silu_module
    x = np.resize(np.array([-1e30, -200.0, -90.0, 0.0, 90.0, 200.0, 1e30], np.float32), 4096)
    got = _silu(executable, x)[:7]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[3:], [0.0, 90.0, 200.0, 1e30], rtol=1e-7)
    assert (np.abs(got[:3]) < 1e-30).all()  # the exact SiLU is -0 in float32 there


def test_silu_leaves_no_libm_call(silu_module) -> None:
    mod, executable = silu_module
    assert "relax.nn.silu" not in mod.script()
    asm = executable.mod.imports[0].inspect_source("asm") if executable.mod.imports else ""
    calls = [line for line in asm.splitlines() if line.strip().startswith("call")]
    assert asm and not [call for call in calls if "exp" in call]
