"""Replace the activations that are ``x * sigmoid(z)`` with the same functions in float32 vector
arithmetic: ``nn.silu`` (``z = x``) and ``nn.gelu_tanh`` (GELU's tanh form, ``0.5 x (1 +
tanh(u)) = x * sigmoid(2u)``, ``u = sqrt(2 / pi) (x + 0.044715 x^3)``). Legalized, each calls
libm (``expf``, ``tanhf``) per element, a scalar call; here the exp is TOPI's polynomial
(``kernels/tir/fast_exp.py``), as the softmax's."""

from __future__ import annotations

import math

import tvm
from tvm import te

from ...kernels.tir.fast_exp import fast_exp
from .replace_op import float32_te_replacement, replace_op_pass

_TANH_SCALE = math.sqrt(2.0 / math.pi)  # transformers' and PyTorch's constants
_TANH_CUBIC = 0.044715


def _times_sigmoid(x, z):
    """``x * sigmoid(z)`` as ``x / (1 + exp(-z))``: exp's range reduction saturates, so the
    quotient stays finite and goes to x or to 0."""
    return x / (1.0 + fast_exp(-z))


def _silu_te(x: te.Tensor) -> te.Tensor:
    return te.compute(x.shape, lambda *index: _times_sigmoid(x(*index), x(*index)), name="silu")


def _gelu_tanh_te(x: te.Tensor) -> te.Tensor:
    def gelu(*index):
        v = x(*index)
        return _times_sigmoid(v, (2.0 * _TANH_SCALE) * (v + _TANH_CUBIC * v * v * v))

    return te.compute(x.shape, gelu, name="gelu_tanh")


def VectorSilu() -> tvm.transform.Pass:  # noqa: N802 - named like the passes it sits among
    return replace_op_pass("VectorSilu", "relax.nn.silu", float32_te_replacement(_silu_te, "silu"))


def VectorGeluTanh() -> tvm.transform.Pass:  # noqa: N802 - named like the passes it sits among
    return replace_op_pass("VectorGeluTanh", "relax.nn.gelu_tanh", float32_te_replacement(_gelu_tanh_te, "gelu_tanh"))
