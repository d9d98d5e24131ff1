"""Replace ``nn.softmax`` with TOPI's ``fast_softmax``: exp by a vectorisable polynomial and
computed once per element (the legalized softmax calls scalar libm ``expf`` twice)."""

from __future__ import annotations

import tvm
from tvm import relax, topi


@relax.expr_functor.mutator
class _SoftmaxToFast(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.nn.softmax":
            return self.builder_.call_te(topi.nn.fast_softmax, call.args[0], call.attrs.axis)
        return call


@tvm.transform.module_pass(opt_level=0, name="FastSoftmax")
class FastSoftmax:
    """Only the softmax part of relax's FastMathTransform (which would also swap erf/tanh)."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        rewriter = _SoftmaxToFast(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return rewriter.builder_.get()
