"""The vectorised ``x * sigmoid(z)`` activations (``compile/passes/sigmoid_activations.py``):
Relax's ``nn.silu`` and ``nn.gelu_tanh`` replaced, compiled through our pipeline's fast-math and
default-schedule passes, against float64 references (numpy's SiLU, PyTorch's tanh GELU), finite
where exp overflows, with no libm call left."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from dietserve.compile.pipeline import default_schedule_pass, fast_math_passes, legalize_passes

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
LENGTH = 4096


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    import torch

    return torch.nn.functional.gelu(torch.from_numpy(x), approximate="tanh").numpy()


ACTIVATIONS = {"silu": (relax.op.nn.silu, _silu), "gelu_tanh": (relax.op.nn.gelu_tanh, _gelu_tanh)}


@pytest.fixture(scope="module", params=sorted(ACTIVATIONS))
def compiled(request):
    """(the activation's name, its module after our passes, the compiled module, its reference)."""
    op, reference = ACTIVATIONS[request.param]
    builder = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((LENGTH,), "float32"))
    with builder.function("main", [x]):
        with builder.dataflow():
            y = builder.emit_output(op(x))
        builder.emit_func_output(y)
    with TARGET:
        mod = tvm.transform.Sequential([*fast_math_passes(), *legalize_passes(), default_schedule_pass(TARGET)])(
            builder.get())
    return request.param, mod, tvm.compile(mod, TARGET), reference


def _run(executable, x: np.ndarray) -> np.ndarray:
    return relax.VirtualMachine(executable, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()


def test_it_is_the_float64_reference_within_float32_resolution(compiled) -> None:
    _, _, executable, reference = compiled
    x = np.concatenate([np.linspace(-30, 30, LENGTH // 2), np.random.default_rng(0).standard_normal(LENGTH // 2) * 4])
    x = x.astype(np.float32)
    exact = reference(x.astype(np.float64))
    error = np.abs(_run(executable, x) - exact)
    # the polynomial exp is within a few ulps, the quotient one more: well inside 1e-6 relative
    assert error.max() <= 1e-6 * np.abs(exact).max()
    away = np.abs(exact) > 1e-6
    assert (error[away] / np.abs(exact[away])).max() < 4e-6


def test_it_stays_finite_where_exp_overflows(compiled) -> None:
    _, _, executable, _ = compiled
    x = np.resize(np.array([-1e30, -200.0, -90.0, 0.0, 90.0, 200.0, 1e30], np.float32), LENGTH)
    got = _run(executable, x)[:7]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[3:], [0.0, 90.0, 200.0, 1e30], rtol=1e-7)
    assert (np.abs(got[:3]) < 1e-30).all()  # the exact values are -0 in float32 there


def test_it_leaves_no_libm_call(compiled) -> None:
    name, mod, executable, _ = compiled
    assert f"relax.nn.{name}" not in mod.script()
    asm = executable.mod.imports[0].inspect_source("asm") if executable.mod.imports else ""
    calls = [line.split()[-1] for line in asm.splitlines() if line.strip().startswith("call")]
    assert asm and not [call for call in calls if call.split("@")[0] in ("expf", "exp", "tanhf", "tanh")]
