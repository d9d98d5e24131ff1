"""Replace exact-erf ``nn.gelu`` with the same GELU whose erf vectorises
(``dietserve/kernels/gelu.py``): libm's ``erff`` is a scalar call per element."""

from __future__ import annotations

import tvm
from tvm import relax, te

from ...kernels.gelu import gelu_expr


def _gelu_te(x: te.Tensor) -> te.Tensor:
    return te.compute(x.shape, lambda *index: gelu_expr(x(*index)), name="gelu")


@relax.expr_functor.mutator
class _GeluToVector(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.nn.gelu"
                and call.args[0].ty.dtype == "float32"):
            return self.builder_.call_te(_gelu_te, call.args[0], primfunc_name_hint="gelu")
        return call


@tvm.transform.module_pass(opt_level=0, name="VectorGelu")
class VectorGelu:
    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        rewriter = _GeluToVector(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return rewriter.builder_.get()
