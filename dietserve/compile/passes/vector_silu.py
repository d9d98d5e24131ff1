"""Replace ``nn.silu`` with the same function in float32 vector arithmetic: its legalized sigmoid
calls libm's ``expf`` per element (a scalar call); here the exp is TOPI's polynomial
(``kernels/tir/fast_exp.py``), as the softmax's."""

from __future__ import annotations

import tvm
from tvm import te

from ...kernels.tir.fast_exp import fast_exp
from .replace_op import replace_op_pass


def _silu_te(x: te.Tensor) -> te.Tensor:
    """``x * sigmoid(x)`` as ``x / (1 + exp(-x))``: exp's range reduction saturates, so the
    quotient stays finite and goes to x or to 0."""
    return te.compute(x.shape, lambda *index: x(*index) / (1.0 + fast_exp(-x(*index))), name="silu")


def _vector_silu(builder, call):
    if call.args[0].ty.dtype != "float32":
        return None
    return builder.call_te(_silu_te, call.args[0], primfunc_name_hint="silu")


def VectorSilu() -> tvm.transform.Pass:  # noqa: N802 - named like the passes it sits among
    return replace_op_pass("VectorSilu", "relax.nn.silu", _vector_silu)
