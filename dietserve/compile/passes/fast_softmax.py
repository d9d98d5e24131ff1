"""Replace ``nn.softmax`` with TOPI's ``fast_softmax``: exp by a vectorisable polynomial and
computed once per element (the legalized softmax calls scalar libm ``expf`` twice). Only the
softmax part of relax's FastMathTransform (which would also swap erf/tanh)."""

from __future__ import annotations

import tvm
from tvm import topi

from .replace_op import replace_op_pass


def FastSoftmax() -> tvm.transform.Pass:  # noqa: N802 - named like the passes it sits among
    return replace_op_pass("FastSoftmax", "relax.nn.softmax",
                           lambda builder, call: builder.call_te(topi.nn.fast_softmax, call.args[0], call.attrs.axis))
