"""Replace exact-erf ``nn.gelu`` with the same GELU in float32 vector arithmetic
(``dietserve/kernels/tir/gelu.py``): libm's ``erff`` is a scalar call per element."""

from __future__ import annotations

import tvm
from tvm import te

from ...kernels.tir.gelu import gelu_expr
from .replace_op import float32_te_replacement, replace_op_pass


def _gelu_te(x: te.Tensor) -> te.Tensor:
    return te.compute(x.shape, lambda *index: gelu_expr(x(*index)), name="gelu")


def VectorGelu() -> tvm.transform.Pass:  # noqa: N802 - named like the passes it sits among
    return replace_op_pass("VectorGelu", "relax.nn.gelu", float32_te_replacement(_gelu_te, "gelu"))
